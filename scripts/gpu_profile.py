"""Latency curve and per-step time split of a pair on one device (GPU and CPU figures of docs/BENCHMARKS.md).

python scripts/gpu_profile.py --target DIR --draft DIR [--device cuda] [--dtype bfloat16] [--max-tokens 128]
Prints T_target(k) and T_draft(k) (ms, median of repeats, 200 cached tokens) at a few k, then the
draft / verify / overhead split of OPT-Tree at a few (budget, delta) on one code prompt.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import opttree
from opttree.calibration.measure import context_ids, latency_curves

parser = argparse.ArgumentParser()
parser.add_argument("--target", required=True)
parser.add_argument("--draft", required=True)
parser.add_argument("--device", default="cuda")
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--max-tokens", type=int, default=128)
args = parser.parse_args()

dtype = getattr(torch, args.dtype)
load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval().to(args.device)
target, draft, tok = load(args.target), load(args.draft), AutoTokenizer.from_pretrained(args.target)
prompt = tok("def binary_search(items, target):\n    \"\"\"Return the index of target in items, or -1.\"\"\"\n",
             return_tensors="pt").input_ids
curves = latency_curves({"target": target, "draft": draft}, context_ids([prompt[0]], 200), args.max_tokens, repeats=5)
ks = [k for k in (1, 2, 4, 8, 9, 16, 17, 24, 32, 48, 64, 96, 128, 192, 256) if k <= args.max_tokens]
print("k        " + "".join(f"{k:>8}" for k in ks))
for name, curve in curves.items():
    print(f"{name:<9}" + "".join(f"{1000 * curve[k - 1]:8.2f}" for k in ks) + "  ms")
for budget, delta in ((0, 0), (16, 0.3), (32, 0.1), (32, 0.3), (64, 0.3), (64, 0.6)):
    kw = dict(tree="ar") if budget == 0 else dict(tree="opt", budget=budget, delta=delta)
    opttree.generate(target, prompt, draft, max_new_tokens=16, **kw)  # warm-up
    s = opttree.generate(target, prompt, draft, max_new_tokens=128, **kw).stats
    per = lambda x: 1000 * x / s.steps
    print(f"{kw}: MAL {s.mean_accepted_length:.2f}, {s.tokens_per_second:.1f} tokens/s; per step: draft {per(s.draft_s):.2f} "
          f"verify {per(s.verify_s):.2f} overhead {per(s.overhead_s):.2f} ms")
