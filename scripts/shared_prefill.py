"""Rows of one prompt prefilled once (`engine.prefill`'s `share`) against each row prefilling its own copy: one prompt
sampled 8 times (`num_return_sequences=8`, T=1, 64 new tokens, plain decoding), the shipped target in float32, 6
HumanEval prompts and 6 Spec-Bench prompts of more than 300 tokens, the two ways interleaved (3 rounds, the first a
warm-up). Prints tokens/s, the prefill and a request's time, and how many prompts got the same choices both ways.

    python scripts/shared_prefill.py
"""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import torch

import opttree
from opttree import engine

DATA = Path(__file__).resolve().parents[2] / "shared/data"
CHOICES, TOKENS = 8, 64


def long_questions(tok, count: int, shortest: int) -> list[str]:
    """The first `count` Spec-Bench first turns of more than `shortest` tokens."""
    found = []
    for line in open(DATA / "spec_bench_questions.jsonl"):
        text = json.loads(line)["turns"][0]
        if len(tok(text).input_ids) > shortest:
            found.append(text)
        if len(found) == count:
            break
    return found


def main() -> None:
    target, _, tok = opttree.demo_models(torch.float32)
    sets = {"HumanEval": [json.loads(line)["prompt"] for line in open(DATA / "humaneval.jsonl")][:6],
            "Spec-Bench > 300 tokens": long_questions(tok, 6, 300)}
    shared = engine.Generation.shares_prompts
    totals = collections.defaultdict(collections.Counter)
    same = 0
    for rnd in range(3):
        for name, prompts in sets.items():
            for i, prompt in enumerate(prompts):
                ids = tok(prompt, return_tensors="pt").input_ids
                answers = {}
                for share in (True, False) if (rnd + i) % 2 else (False, True):  # alternate which goes first
                    engine.Generation.shares_prompts = shared if share else property(lambda self: False)
                    start = time.perf_counter()
                    outs = opttree.generate(target, ids, num_return_sequences=CHOICES, temperature=1.0, seed=i,
                                            max_new_tokens=TOKENS)
                    seconds = time.perf_counter() - start
                    answers[share] = [out.new_tokens.tolist() for out in outs]
                    if rnd:
                        total = totals[(name, share)]
                        total["s"] += seconds
                        total["tokens"] += sum(len(out.new_tokens) for out in outs)
                        total["prefill"] += outs[0].stats.prefill_s
                        total["prompt"] += ids.shape[1]
                        total["runs"] += 1
                same += rnd > 0 and answers[True] == answers[False]
    engine.Generation.shares_prompts = shared
    for (name, share), total in totals.items():
        runs = total["runs"]
        print(f"{name:24s} prefilled {'once' if share else 'per row':7s} prompt {total['prompt'] / runs:.0f} tokens: "
              f"{total['tokens'] / total['s']:.1f} tokens/s, prefill {1e3 * total['prefill'] / runs:.0f} ms, "
              f"request {total['s'] / runs:.2f} s")
    print(f"the same {CHOICES} choices both ways: {same} of {sum(map(len, sets.values())) * 2} requests")


if __name__ == "__main__":
    main()
