"""Decoding speed by prompt length: opttree's KV cache written in place (`GrowingLayer`) against
transformers' concatenating `DynamicLayer` (the same code with the layer's update swapped back), and
transformers' own `generate` beside them. Interleaved: every round runs every (length, method, cache).

    python scripts/long_prompts.py                                  # shipped pair, bf16, 64 .. 1536 tokens
    python scripts/long_prompts.py --lengths 256,1024 --methods ar,opt --rounds 2 --dtype float32
    python scripts/long_prompts.py --device cuda                    # (scripts/gpu_figures.sh long)

Prompts: windows of the HumanEval prompts laid end to end (`--prompts`), `--per-length` of them per
length. A method is `ar`, a tree policy with the calibrated settings (`opt`), `POLICY:DRAFTER`, or
`hf-ar` (`target.generate`, greedy, its own dynamic cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers.cache_utils import DynamicLayer

import opttree
from opttree.device import synchronize
from opttree.step.cache import GrowingLayer

IN_PLACE = GrowingLayer.update


def windows(path: Path, tokenizer, length: int, count: int) -> list[torch.Tensor]:
    text = "".join(json.loads(line)["prompt"] for line in path.open())
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    step = max(1, (ids.shape[0] - length) // max(count, 1))
    return [ids[i * step: i * step + length][None] for i in range(count)]


def run(method: str, target, draft, prompt: torch.Tensor, new: int) -> tuple[int, float, int]:
    """(new tokens, seconds, steps) of one greedy generation."""
    synchronize(prompt.device)
    start = time.perf_counter()
    if method == "hf-ar":
        out = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False)
        synchronize(prompt.device)
        return out.shape[1] - prompt.shape[1], time.perf_counter() - start, out.shape[1] - prompt.shape[1]
    policy, _, drafter = method.partition(":")
    options = {"drafter": drafter} if drafter else {}
    uses_draft = policy != "ar" and (not drafter or "model" in drafter)
    result = opttree.generate(target, prompt, draft if uses_draft else None, tree=policy, max_new_tokens=new, **options)
    synchronize(prompt.device)
    return result.stats.new_tokens, time.perf_counter() - start, result.stats.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="64,512,1024,1536")
    parser.add_argument("--methods", default="ar,opt,hf-ar")
    parser.add_argument("--per-length", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompts", type=Path, default=Path(__file__).parents[2] / "shared/data/humaneval.jsonl")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    target, draft, tokenizer = opttree.demo_models(dtype=getattr(torch, args.dtype))
    target, draft = target.to(args.device), draft.to(args.device)
    lengths, methods = [int(x) for x in args.lengths.split(",")], args.methods.split(",")
    caches = {"in place": IN_PLACE, "concatenated": DynamicLayer.update}
    cells = [(length, method, cache) for length in lengths for method in methods
             for cache in (caches if method != "hf-ar" else ["transformers"])]
    prompts = {length: [ids.to(args.device) for ids in windows(args.prompts, tokenizer, length, args.per_length)]
               for length in lengths}
    speeds: dict[tuple, list[float]] = {cell: [] for cell in cells}
    step_ms: dict[tuple, list[float]] = {cell: [] for cell in cells}
    for method in methods:  # warm-up: packing checks, calibration, first-call costs
        run(method, target, draft, prompts[lengths[0]][0], 8)
    for round_ in range(args.rounds):
        for cell in cells:
            length, method, cache = cell
            GrowingLayer.update = caches.get(cache, IN_PLACE)
            tokens = seconds = taken = 0
            for prompt in prompts[length]:
                n, s, k = run(method, target, draft, prompt, args.max_new_tokens)
                tokens, seconds, taken = tokens + n, seconds + s, taken + k
            speeds[cell].append(tokens / seconds)
            step_ms[cell].append(seconds / taken * 1e3)
            print(f"round {round_ + 1}: {length} tokens, {method}, {cache}: {tokens / seconds:.1f} tokens/s", flush=True)
    GrowingLayer.update = IN_PLACE
    print("\n| prompt tokens | method | KV cache | tokens/s (median) | ms per step | in place / concatenated |")
    print("|---:|---|---|---:|---:|---:|")
    for length, method, cache in cells:
        median = statistics.median(speeds[length, method, cache])
        ratio = ""
        if cache == "in place":
            ratio = f"{median / statistics.median(speeds[length, method, 'concatenated']):.2f}x"
        print(f"| {length} | {method} | {cache} | {median:.1f} | {statistics.median(step_ms[length, method, cache]):.2f} | {ratio} |")


if __name__ == "__main__":
    main()
