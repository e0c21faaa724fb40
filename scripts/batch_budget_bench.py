"""Batch-level OPT-Tree (`batch_budget=`) against per-row trees, in-process (no HTTP): the first 16
HumanEval prompts as two batches of 8, `opt:recycling+lookup`, 64 new tokens, the shipped pair (float32,
or the dtype given); 3 rounds, the settings rotated per round. `off`: each row 16 nodes; `8 each`: each row
8; `sized`: each row the budget sized for 8 rows (`opttree.batch_sizing`); `auto` = BatchBudget over the
target's latency curve measured first (k = 1..136 tokens, 200 cached); a number N: N nodes for the batch.

    python scripts/batch_budget_bench.py [bfloat16]
"""
import sys
import statistics
import time

import torch

import opttree
from opttree.bench.prompts import load_prompts
from opttree.calibration.measure import context_ids, latency_curves
from opttree.step.policies.batch import BatchBudget

torch.manual_seed(0)
target, draft, tok = opttree.demo_models(getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32"))
prompts = [tok(p.text, return_tensors="pt").input_ids[0] for p in load_prompts("../shared/data/humaneval.jsonl", limit=16)]
curve = latency_curves({"target": target}, context_ids(prompts[:1], 200), 8 * 17, repeats=3)["target"]
configs = {"off": (16, None), "8 each": (8, None), "sized": (16, "sized"), "auto": (16, BatchBudget(curve=curve)),
           "16": (16, 16), "32": (16, 32), "64": (16, 64)}  # (each row's budget, batch_budget)
res = {k: [] for k in configs}
mal = {k: [] for k in configs}
for rnd in range(3):
    for group in (prompts[:8], prompts[8:]):
        names = list(configs)
        names = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in names:
            t = time.perf_counter()
            budget, shared = configs[name]
            outs = opttree.generate(target, group, None, budget=budget, max_new_tokens=64, batch_budget=shared)
            dt = time.perf_counter() - t
            toks = sum(o.stats.new_tokens for o in outs)
            res[name].append(toks / dt)
            mal[name].append(toks / sum(o.stats.steps for o in outs))
for k in configs:
    print(f"{k:>5}: {statistics.mean(res[k]):6.1f} tok/s (min {min(res[k]):.1f}, max {max(res[k]):.1f}), tokens per row-step {statistics.mean(mal[k]):.2f}")
print("T(k) ms at k=1,8,17,34,68,136:", [round(1000 * curve[k - 1], 1) for k in (1, 8, 17, 34, 68, 136)])
