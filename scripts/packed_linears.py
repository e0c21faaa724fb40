"""Packed linear weights (`opttree.packed`) against the plain layers: the same methods with and without
them, interleaved per prompt (the order rotated), in one process; every output compared token for token.

    python scripts/packed_linears.py --limit 20                 # HumanEval's first 20, 128 tokens, bf16
    python scripts/packed_linears.py --layers                   # also each linear shape of the target alone
    python scripts/packed_linears.py --dtype float32 --layers --limit 0    # float32's shapes alone

The train-free sources' state (Token Recycling's matrix) is reset before every generation, so both
versions of a method start from the same state and must give the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

import opttree
from opttree.packed import packed_linears
from opttree.step.drafters.estimates import forget

METHODS = {"ar": dict(tree="ar"), "opt:recycling+lookup@16": dict(drafter="recycling+lookup", budget=16),
           "opt:model@8": dict(budget=8), "opt:head@16": dict(drafter="head", budget=16)}


def layer_times(target) -> None:
    """Median microseconds of each distinct linear shape, plain and packed, at 1, 9 and 17 rows."""
    pack = packed_linears(target)
    if pack is None:
        print("packing does not apply here (no oneDNN kernels for this CPU and dtype, or not enough memory)")
        return
    seen = set()
    for layer, packed, rows in pack.layers:
        shape = (layer.in_features, layer.out_features)
        if shape in seen:
            continue
        seen.add(shape)
        cells = []
        for m in (1, 9, 17):
            x = torch.randn(m, layer.in_features).to(layer.weight.dtype)
            plain = _median(lambda: F.linear(x, layer.weight, layer.bias))
            fast = _median(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], ""))
            cells.append(f"{m} rows: {plain:.0f} -> {fast:.0f} us")
        print(f"linear {shape[0]} x {shape[1]} (run packed at {rows.start}-{rows.stop - 1} rows): " + ", ".join(cells))


def _median(call, n: int = 300) -> float:
    with torch.inference_mode():
        for _ in range(20):
            call()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    return 1e6 * sorted(times)[n // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="../shared/data/humaneval.jsonl")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--layers", action="store_true", help="time each linear shape alone first")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    target, draft, tok = opttree.demo_models(getattr(torch, args.dtype))
    if args.layers:
        layer_times(target)
    lines = open(args.prompts).read().splitlines()[: args.limit]
    prompts = [tok(json.loads(line)["prompt"], return_tensors="pt").input_ids for line in lines]
    if not prompts:
        return
    runs = [(name, packed) for name in METHODS for packed in (False, True)]
    for name, packed in runs:  # first calls (packing, kernels) out of the timing
        os.environ["OPTTREE_PACKED"] = str(int(packed))
        opttree.generate(target, prompts[0], draft if ":model" in name else None, max_new_tokens=8, **METHODS[name])
    totals = {run: [0, 0, 0.0] for run in runs}  # new tokens, steps, seconds
    outputs: dict = {}
    differ = {name: 0 for name in METHODS}
    for j, ids in enumerate(prompts):
        for k in range(len(runs)):
            name, packed = runs[(j + k) % len(runs)]
            os.environ["OPTTREE_PACKED"] = str(int(packed))
            forget(target)
            start = time.perf_counter()
            out = opttree.generate(target, ids, draft if ":model" in name else None, max_new_tokens=args.max_new_tokens,
                                   eos_token_id=[], **METHODS[name])
            seconds = time.perf_counter() - start
            tally = totals[(name, packed)]
            tally[0], tally[1], tally[2] = tally[0] + out.stats.new_tokens, tally[1] + out.stats.steps, tally[2] + seconds
            if (name, j) in outputs:
                differ[name] += not torch.equal(outputs[(name, j)], out.sequences)
            outputs[(name, j)] = out.sequences
    print(f"\n{len(prompts)} prompts, {args.max_new_tokens} new tokens, {args.dtype}, interleaved\n")
    print("| method | MAL | tokens/s plain | tokens/s packed | packed / plain | outputs that differ |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in METHODS:
        (new, steps, plain_s), (_, _, packed_s) = totals[(name, False)], totals[(name, True)]
        print(f"| {name} | {new / steps:.2f} | {new / plain_s:.1f} | {new / packed_s:.1f} | "
              f"{plain_s / packed_s:.2f}x | {differ[name]} of {len(prompts)} |")


if __name__ == "__main__":
    main()
