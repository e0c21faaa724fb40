"""Eager vs static vs torch.compile'd steps on the CPU, one interleaved run (issue: a leaner CPU step).

python scripts/cpu_compile_bench.py [--prompts FILE.jsonl] [--limit 20] [--max-new-tokens 128] [--dtype float32]
                                   [--only hf-ar,ar,opt,...]

Methods, per prompt in rotated order: `hf-ar` (transformers' greedy generate), `ar` and `opt` (opttree,
the shipped profile's budget / delta / draft temperature), each also with `+static` (the static path:
padded trees over a preallocated cache), `+compile` (a second copy of the pair whose forwards are
torch.compile'd with dynamic shapes) and `+static+compile` (a third copy: the target's and the
draft's fixed-shape steps compiled, what `--compile` does); `opt+static+compile(dynamic draft)` (a
fourth copy: the target's step compiled, the draft's forward as in `+compile`). Compilation happens
before timing (its time is printed). Prints tokens/s, speedup over `ar` and whether every output
equals `ar`'s. `--only` keeps some of the methods (`ar` always runs: the reference).
"""

import argparse
import json
import time

from opttree.threads import choose_openmp_wait_policy, set_torch_threads

choose_openmp_wait_policy()  # as the CLI does, before torch loads OpenMP
import torch  # noqa: E402

import opttree
from opttree.device import compile_model
from opttree.step.cache import static_capacity

parser = argparse.ArgumentParser()
parser.add_argument("--prompts", default="../shared/data/humaneval.jsonl")
parser.add_argument("--limit", type=int, default=20)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--dtype", default="float32")
parser.add_argument("--only", help="comma-separated methods to run (default: all)")
args = parser.parse_args()

set_torch_threads()
dtype = getattr(torch, args.dtype)
target, draft, tok = opttree.demo_models(dtype)
c_target, c_draft, _ = opttree.demo_models(dtype)
compile_model(c_target, static=False), compile_model(c_draft, static=False)
s_target, s_draft, _ = opttree.demo_models(dtype)
compile_model(s_target), compile_model(s_draft)
d_target, d_draft, _ = opttree.demo_models(dtype)
compile_model(d_target), compile_model(d_draft, static=False)
opt = dict(tree="opt", budget=8, delta=0.6, draft_temperature=0.537)
prompts = [json.loads(line)["prompt"] for line in open(args.prompts)][: args.limit]
encoded = [tok(p, return_tensors="pt").input_ids for p in prompts]


def hf(ids):
    with torch.inference_mode():
        return target.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens, attention_mask=torch.ones_like(ids))


def ours(pair, tree, static):
    t, d = pair
    options = opt if tree == "opt" else dict(tree="ar")
    return lambda ids: opttree.generate(t, ids, d if tree == "opt" else None, max_new_tokens=args.max_new_tokens,
                                        static=static, **options).sequences


methods = {"hf-ar": hf}
for tree in ("ar", "opt"):
    methods[tree] = ours((target, draft), tree, False)
    methods[f"{tree}+static"] = ours((target, draft), tree, True)
    methods[f"{tree}+compile"] = ours((c_target, c_draft), tree, False)
    methods[f"{tree}+static+compile"] = ours((s_target, s_draft), tree, True)
methods["opt+static+compile(dynamic draft)"] = ours((d_target, d_draft), "opt", True)
if args.only:
    kept = {"ar", *args.only.split(",")}
    methods = {name: fn for name, fn in methods.items() if name in kept}# Warm-up: one prompt per static-cache capacity bucket, so that every shape is compiled before timing
# (a step is compiled once per budget and bucket; its compilation time is printed, not timed below).
# (a static draft's cache holds max_depth = 8 layers of slots too: its bucket may differ from the target's)
buckets = {(static_capacity(ids.shape[1] + args.max_new_tokens + opt["budget"]),
            static_capacity(ids.shape[1] + args.max_new_tokens + 8 * opt["budget"] + 1)): ids for ids in encoded}
for name, fn in methods.items():
    start = time.time()
    for ids in buckets.values():
        fn(ids)
    print(f"warm-up {name}, {len(buckets)} capacity buckets (compilation included): {time.time() - start:.0f} s",
          flush=True)
times, tokens, same = ({name: 0.0 for name in methods} for _ in range(3))
names = list(methods)
for i, ids in enumerate(encoded):
    outputs = {}
    for name in names[i % len(names):] + names[: i % len(names)]:
        t0 = time.perf_counter()
        outputs[name] = methods[name](ids)
        times[name] += time.perf_counter() - t0
        tokens[name] += outputs[name].shape[1] - ids.shape[1]
    for name in names:
        same[name] += torch.equal(outputs[name], outputs["ar"])
print(f"| method | tokens/s | speedup over ar | outputs equal to ar's |\n|---|---:|---:|---:|")
ar_tps = tokens["ar"] / times["ar"]
for name in names:
    tps = tokens[name] / times[name]
    print(f"| {name} | {tps:.1f} | {tps / ar_tps:.2f}x | {int(same[name])}/{len(encoded)} |")
