"""The target's verify forward over a batch, by tokens a row, timed interleaved (`batch_sizing.verify_ms`): where a
batch's total rows cross a size the CPU's matrix kernels handle badly. Optionally against the same target with its
linear layers packed for more rows than `opttree.packed.MAX_ROWS` (checked bit for bit first, as opttree does).

    python scripts/batch_widths.py                                  # 8 rows, 9..33 tokens a row, bf16
    python scripts/batch_widths.py --rows 4 --widths 16,17,32,33 --packed-rows 256
"""

from __future__ import annotations

import argparse
import statistics

import torch

import opttree
import opttree.packed as packed
from opttree import batch_sizing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--widths", default="9,16,17,18,24,33", help="tokens a row (the root and its tree)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--packed-rows", type=int, default=0, help="also a copy packed for up to this many rows")
    args = parser.parse_args()
    models = {}
    for rows in [packed.MAX_ROWS] + ([args.packed_rows] if args.packed_rows else []):
        packed.MAX_ROWS = rows  # each copy packed now, with its own checked limits (kept apart in the user cache)
        models[f"packed to {rows} rows"] = model = opttree.demo_models(getattr(torch, args.dtype))[0]
        packed.packed_linears(model)
    batch_sizing.WIDTHS = tuple(int(w) for w in args.widths.split(","))
    batch_sizing.REPEATS = 3
    times = {name: {w: [] for w in batch_sizing.WIDTHS} for name in models}
    for r in range(args.rounds):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            for w, ms in zip(batch_sizing.WIDTHS, batch_sizing.verify_ms(models[name], args.rows)):
                times[name][w].append(ms)
    print(f"{args.rows} rows, {args.dtype}, median ms of {args.rounds} rounds x {batch_sizing.REPEATS} forwards")
    print("| target | " + " | ".join(f"{w} a row ({args.rows * w} rows)" for w in batch_sizing.WIDTHS) + " |")
    print("|---|" + "---:|" * len(batch_sizing.WIDTHS))
    for name, by_width in times.items():
        print(f"| {name} | " + " | ".join(f"{statistics.median(v):.1f}" for v in by_width.values()) + " |")


if __name__ == "__main__":
    main()
