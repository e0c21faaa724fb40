"""A batch `generate` (and `stream`) of prompts of very different lengths against the same prompts one at a time,
with and without the longest: what padding every row to the longest costs a batch (`batch_sizing.length_lanes`).

    python scripts/batch_lengths.py                      # examples/mixed-lengths.jsonl, bf16, 64 new tokens
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import opttree
from opttree.bench.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, default=ROOT / "examples/mixed-lengths.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    target, _, tokenizer = opttree.demo_models(dtype=getattr(torch, args.dtype))
    every = [tokenizer(p.text, return_tensors="pt").input_ids[0] for p in load_prompts(args.prompts)]
    longest = max(p.shape[0] for p in every)
    opttree.generate(target, every[:2], max_new_tokens=8)  # warm-up (and the batch timing, once per machine)
    for name, batch in (("every prompt", every), ("without the longest", [p for p in every if p.shape[0] < longest])):
        start = time.perf_counter()
        outs = opttree.generate(target, batch, max_new_tokens=args.max_new_tokens)
        batched = sum(out.stats.new_tokens for out in outs) / (time.perf_counter() - start)
        start = time.perf_counter()
        streamed = sum(chunk.numel() for _, chunk in opttree.stream(target, batch, max_new_tokens=args.max_new_tokens))
        streamed /= time.perf_counter() - start
        start = time.perf_counter()
        outs = [opttree.generate(target, p[None], max_new_tokens=args.max_new_tokens) for p in batch]
        single = sum(out.stats.new_tokens for out in outs) / (time.perf_counter() - start)
        print(f"{name} ({len(batch)} prompts, {min(p.shape[0] for p in batch)}-{max(p.shape[0] for p in batch)} "
              f"tokens): a batch {batched:.1f} tokens/s, streamed {streamed:.1f}, one at a time {single:.1f}")


if __name__ == "__main__":
    main()
