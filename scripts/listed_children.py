"""OPT-Tree over Token Recycling: the tree built from children listed on the host (NumPy views of the matrix, where it
lives on the CPU) against the same policy asking the matrix's tensors (`OPTTREE_LISTED=device`), alternated call by
call on one learned matrix; checks that both give the same tree.

    python scripts/listed_children.py                      # budgets 4, 8, 16, 64; bf16 shipped target
    python scripts/listed_children.py --budgets 16 --calls 500

The matrix and its hit rates are learned first from greedy generations of HumanEval's first --limit prompts
(`opt:recycling`, the shipped target); each call then builds a tree rooted at one of those generations' tokens, at the
delta and depth a train-free source drafts at (0.1, the budget).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import opttree
from opttree.bench.prompts import load_prompts
from opttree.settings.config import SpecConfig
from opttree.step.drafters.recycling import RecyclingDrafter
from opttree.step.policies.opt import OptTree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="../shared/data/humaneval.jsonl")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--budgets", default="4,8,16,64")
    parser.add_argument("--calls", type=int, default=300, help="timed calls each way per budget")
    args = parser.parse_args()
    target, _, tok = opttree.demo_models(torch.bfloat16)
    roots = []
    for prompt in load_prompts(args.prompts, limit=args.limit):
        ids = tok(prompt.text, return_tensors="pt").input_ids
        out = opttree.generate(target, ids, None, tree="opt", drafter="recycling", budget=16, max_new_tokens=64)
        roots += out.new_tokens.tolist()
    drafter = RecyclingDrafter(target, target.config.vocab_size)  # the matrix those generations learned
    print(f"{len(roots)} roots; recycling matrix of {drafter.matrix.vocab} rows, {int(drafter.matrix.filled.sum())} "
          "written")
    print("| budget | tensors' children, us a tree | listed on the host, us a tree | nodes | same trees |")
    print("|---:|---:|---:|---:|---|")
    with torch.inference_mode():
        for budget in map(int, args.budgets.split(",")):
            policy = OptTree(SpecConfig(budget=budget, max_depth=budget))  # delta 0.1, as train-free sources draft
            ways = {"tensors": policy._build_stop_on_host, "host": policy._build_listed_on_host}
            times = {name: [] for name in ways}
            same, nodes = True, []
            for call in range(args.calls + 10):
                committed = torch.tensor([roots[call % len(roots)]])
                trees = {}
                for name, build in (ways.items() if call % 2 else reversed(ways.items())):
                    began = time.perf_counter()
                    trees[name] = build(drafter, committed, policy.max_depth)
                    if call >= 10:
                        times[name].append(time.perf_counter() - began)
                same &= all(torch.equal(getattr(trees["host"], f), getattr(trees["tensors"], f))
                            for f in ("tokens", "parents", "depths", "scores"))
                nodes.append(len(trees["host"]))
            print(f"| {budget} | {1e6 * statistics.median(times['tensors']):.0f} | "
                  f"{1e6 * statistics.median(times['host']):.0f} | {statistics.fmean(nodes):.1f} | {same} |")


if __name__ == "__main__":
    main()
