"""One forward of the shipped target (lean) and of its draft (its own forward) over a cache kept in bf16 or in float32
(`opttree.step.lean.float32_attention`), by query count and cache length: what keeping one sequence's keys and values
in float32 changes per forward on this CPU (the target's linears packed as in a generation). The two dtypes alternate
call by call; medians of `--repeats` calls.

    python scripts/attention_dtype.py                         # queries 1, 4, 17 over 150, 400, 1,000 cached positions
    python scripts/attention_dtype.py --queries 1 --lengths 2000
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import opttree
from opttree.step.cache import cache_argument, new_cache, stack_rows, truncate
from opttree.step.draft_forward import DraftForward
from opttree.packed import entered, packed_linears
from opttree.step.lean import lean_forward


def tree_mask(length: int, queries: int) -> torch.Tensor:
    """(1, 1, Q, length + Q) bool: every query sees the cache and itself and the queries before it (a chain)."""
    mask = torch.ones(queries, length + queries, dtype=torch.bool).tril(length)
    return mask[None, None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", default="1,4,17")
    parser.add_argument("--lengths", default="150,400,1000")
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    target, draft, _ = opttree.demo_models(dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    print("| model | cached positions | queries | bf16 cache, us | float32 cache, us | float32 / bf16 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, model in (("target", target), ("draft", draft)):
        pack = packed_linears(model)  # the target's linears as a generation runs them (bf16 kernels packed)
        runners = {}  # the draft's own forward, one for each dtype of its cache (made once: it copies the weights)
        for dtype in (torch.bfloat16, torch.float32):
            runners[dtype] = DraftForward(model) if name == "draft" else None
            if name == "draft":
                runners[dtype].attention_dtype = dtype
        for length in map(int, args.lengths.split(",")):
            prompt = torch.randint(3, 8000, (1, length), generator=generator)
            caches = {}
            with torch.inference_mode():
                bf16 = new_cache(model)
                model(input_ids=prompt, **{cache_argument(model): bf16})
                caches[torch.bfloat16] = bf16
                caches[torch.float32] = stack_rows([(bf16, [length])], torch.float32)
            for queries in map(int, args.queries.split(",")):
                tokens = torch.randint(3, 8000, (1, queries), generator=generator)
                positions = torch.arange(length, length + queries)[None]
                mask = tree_mask(length, queries)
                times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in caches}
                for repeat in range(args.repeats + 3):
                    for dtype, cache in caches.items():
                        forward = lean_forward(model, mask) if name == "target" else runners[dtype]
                        with torch.inference_mode(), entered([pack] if pack is not None else []):
                            start = time.perf_counter()
                            forward(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache)
                            spent = time.perf_counter() - start
                            truncate(cache, length)
                        if repeat >= 3:
                            times[dtype].append(spent)
                half, full = (1e6 * statistics.median(times[d]) for d in (torch.bfloat16, torch.float32))
                print(f"| {name} | {length} | {queries} | {half:.0f} | {full:.0f} | {full / half:.2f} |", flush=True)


if __name__ == "__main__":
    main()
