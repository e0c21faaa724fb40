"""What an environment switch gains for batches of the shipped pair in bf16 (plain decoding greedy and sampled, `opt`
with no flags, one prompt of each batch alone too): toggled generation by generation, alternated round by round, each
variant learning apart (`kept_apart`). By default the switch keeps a batch's keys and values in float32
(`opttree.step.lean.float32_attention`; `OPTTREE_FLOAT32_ATTENTION` auto: where this machine's sdpa runs faster so)
or not (0).

    python scripts/float32_attention.py                  # HumanEval 16, batches of 8, 64 new tokens, 3 rounds
    python scripts/float32_attention.py --switch OPTTREE_MERGE=device,host   # tries merged on the device / host
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import opttree
from opttree.bench.prompts import load_prompts
from opttree.step.drafters.estimates import kept_apart
from opttree.step.lean import float32_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="../shared/data/humaneval.jsonl")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--switch", default="OPTTREE_FLOAT32_ATTENTION=0,auto", help="NAME=BEFORE,AFTER")
    args = parser.parse_args()
    switch, values = args.switch.split("=")
    variants = tuple(values.split(","))
    target, _, tokenizer = opttree.demo_models(dtype=torch.bfloat16)
    texts = load_prompts(args.prompts, limit=args.limit)
    prompts = [tokenizer(p.text, return_tensors="pt").input_ids[0] for p in texts]
    groups = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
    new = args.max_new_tokens
    methods = {
        f"ar x{args.batch}": lambda group: opttree.generate(target, group, tree="ar", max_new_tokens=new),
        f"opt x{args.batch}": lambda group: opttree.generate(target, group, max_new_tokens=new),
        f"ar x{args.batch}, T=1": lambda group: opttree.generate(target, group, tree="ar", max_new_tokens=new,
                                                                 temperature=1.0, seed=0),
        "opt x1": lambda group: [opttree.generate(target, group[0][None], max_new_tokens=new)],
    }
    os.environ["OPTTREE_FLOAT32_ATTENTION"] = "auto"
    print(f"float32 attention applies here: {float32_attention(target)}")
    for run in methods.values():  # warm-up
        for variant in variants:
            os.environ[switch] = variant
            with kept_apart(target, {}):
                run(groups[0][:3])
    tally = {(name, variant): [0, 0.0] for name in methods for variant in variants}  # tokens, seconds
    learnt = {key: {} for key in tally}
    for r in range(args.rounds):
        for group in groups:
            for name, run in methods.items():
                for variant in variants if r % 2 == 0 else variants[::-1]:
                    os.environ[switch] = variant
                    start = time.perf_counter()
                    with kept_apart(target, learnt[name, variant]):
                        outs = run(group)
                    tally[name, variant][1] += time.perf_counter() - start
                    tally[name, variant][0] += sum(out.stats.new_tokens for out in outs)
    os.environ.pop(switch)
    print(f"{len(prompts)} prompts, {new} new tokens, bf16, {args.rounds} rounds; tokens/s:")
    print(f"| method | {switch}={variants[0]} | {switch}={variants[1]} | gain |\n|---|---:|---:|---:|")
    for name in methods:
        (n0, s0), (n1, s1) = tally[name, variants[0]], tally[name, variants[1]]
        print(f"| {name} | {n0 / s0:.1f} | {n1 / s1:.1f} | {n1 / s1 / (n0 / s0):.2f}x |")


if __name__ == "__main__":
    main()
