"""Draft sources without the draft model (train-free ones, and the shipped feature head) at several deltas
against plain decoding, interleaved per prompt (settings rotated), in the dtype given: mean accepted length,
tokens/s and speedup.

    python scripts/source_deltas.py --prompts examples/heldout-code.jsonl --count 23 --dtype bfloat16 \\
        'recycling+lookup:0,0.1,0.3,0.6' 'lookup:0.1,0.6'
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import opttree
from opttree.parts import shipped_part


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="+", help="DRAFTER:DELTA,DELTA,... (budget --budget)")
    parser.add_argument("--prompts", default="examples/heldout-code.jsonl")
    parser.add_argument("--count", type=int, default=23)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    args = parser.parse_args()
    target, _, tok = opttree.demo_models(getattr(torch, args.dtype))
    head = shipped_part("head", target)  # the shipped target's feature head, for drafters naming `head`
    lines = open(args.prompts).read().splitlines()[: args.count]
    prompts = [tok(json.loads(line)["prompt"], return_tensors="pt").input_ids for line in lines]
    runs = {"ar": dict(tree="ar")}
    for item in args.settings:
        drafter, _, deltas = item.partition(":")
        for delta in deltas.split(","):
            runs[f"{drafter}@{args.budget} delta {delta}"] = dict(drafter=drafter, budget=args.budget, delta=float(delta),
                                                                   **({"head": head} if "head" in drafter else {}))
    for options in runs.values():  # probes and first calls out of the timing
        opttree.generate(target, prompts[0], max_new_tokens=8, eos_token_id=[], **options)
    totals = {name: [0, 0, 0.0] for name in runs}  # new tokens, steps, seconds
    names = list(runs)
    for j, ids in enumerate(prompts):
        for name in names[j % len(names):] + names[: j % len(names)]:
            start = time.perf_counter()
            out = opttree.generate(target, ids, max_new_tokens=args.max_new_tokens, eos_token_id=[], **runs[name])
            totals[name][2] += time.perf_counter() - start
            totals[name][0] += out.stats.new_tokens
            totals[name][1] += out.stats.steps
    plain = totals["ar"][0] / totals["ar"][2]
    for name, (new, steps, seconds) in totals.items():
        print(f"{name}: MAL {new / steps:.2f}, {new / seconds:.1f} tokens/s, {new / seconds / plain:.2f}x")


if __name__ == "__main__":
    main()
