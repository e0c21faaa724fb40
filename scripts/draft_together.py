"""A batch's rows drafting with the draft model together (`opttree.step.drafters.together`: a thread a row,
one batched draft forward per round) against each row drafting on its own, interleaved in one process:

    python scripts/draft_together.py --rows 8 --prompts ../shared/data/humaneval.jsonl --limit 16 --rounds 3

The shipped pair in bfloat16 (--dtype), OPT-Tree with the draft model at --budget, --max-new-tokens each;
prints the aggregate tokens/s of each way (`engine.DRAFT_ALONE_ON` decides which the engine takes).
"""

from __future__ import annotations

import argparse
import time

import torch

import opttree
from opttree import engine
from opttree.bench.prompts import encode, load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompts", default="../shared/data/humaneval.jsonl")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    target, draft, tok = opttree.demo_models(getattr(torch, args.dtype))
    prompts = [encode(tok, p)[0] for p in load_prompts(args.prompts, limit=args.limit)]
    speculator = opttree.Speculator(target, draft, budget=args.budget, max_new_tokens=args.max_new_tokens,
                                    eos_token_id=tok.eos_token_id)
    ways = {"together": frozenset(), "alone": frozenset({target.device.type})}  # DRAFT_ALONE_ON for each
    groups = [prompts[i : i + args.rows] for i in range(0, len(prompts), args.rows)]
    speculator.generate([opttree.Request(ids) for ids in groups[0]])  # warm-up
    totals = {way: [0, 0.0] for way in ways}
    for _ in range(args.rounds):
        for group in groups:
            for way, alone_on in ways.items():
                engine.DRAFT_ALONE_ON = alone_on
                start = time.perf_counter()
                outs = speculator.generate([opttree.Request(ids) for ids in group])
                totals[way][1] += time.perf_counter() - start
                totals[way][0] += sum(out.stats.new_tokens for out in outs)
    for way, (tokens, seconds) in totals.items():
        print(f"{way:9s} {tokens / seconds:7.1f} tokens/s ({args.rows} rows, budget {args.budget}, {args.dtype})")


if __name__ == "__main__":
    main()
