"""What a request joining a running batch costs the batch: its prompt prefilled in a forward of its own
(`OPTTREE_RIDE=0`) against riding the next step's forward (`lean.Rider`), measured in one process, the order
alternated.

    python scripts/join_cost.py                      # 8 rows of budget 4 (a sized batch's trees at 8 rows)
    python scripts/join_cost.py --budget 16 --joins 24
    python scripts/join_cost.py --target /tmp/opttree-target-1b --device cuda --budget 16    # another target
    python scripts/join_cost.py --stack              # the cache stacked anew as a row joins (`cache.stack_rows`)

A batch of 8 HumanEval prompts (`opt:recycling+lookup`, bf16, the shipped pair) runs; each round times a plain step,
then for each way a joining prompt (the next HumanEval prompt) is admitted: the admission and every step until it
is in the batch's cache, less as many plain steps (the median of the last five), is its cost; it is then cancelled,
so the batch keeps 8 rows (the batch starts afresh before a row nears its end). Prints the median cost of each way.
`--stack`: the part of a join that makes the batch's cache, alone: 8 rows of 180-229 positions and a joining row of
120, in float32 (as a batch of bf16 rows attends on some CPUs), the median of 30 calls each way: stacked anew, and
written into a cache with room for 9 rows (as the server's batches keep: `stack_rows(rows_room=...)`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

import opttree
from opttree.bench.prompts import load_prompts
from opttree.step.cache import cache_argument, new_cache, select_rows, stack_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="../shared/data/humaneval.jsonl")
    parser.add_argument("--budget", type=int, default=4)
    parser.add_argument("--joins", type=int, default=40, help="joins timed each way")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--target", help="a model folder of the shipped tokenizer's vocabulary (default: shipped)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--stack", action="store_true", help="time the batch's cache stacked anew, alone")
    args = parser.parse_args()
    target, _, tok = opttree.demo_models(getattr(torch, args.dtype))
    if args.target:
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype))
    target = target.to(args.device)
    if args.stack:
        return stack_cost(target)
    ids = [tok(p.text, return_tensors="pt").input_ids[0].to(args.device) for p in load_prompts(args.prompts, limit=40)]
    speculator = opttree.Speculator(target, None, drafter="recycling+lookup", budget=args.budget, eos_token_id=[],
                                    max_new_tokens=220)

    def fresh():
        run = speculator.stream([opttree.Request(p) for p in ids[:8]])
        for _ in range(5):
            run.step()
        return run

    def timed(run) -> float:
        began = time.perf_counter()
        run.step()  # (its tokens read on the host: synchronised)
        return time.perf_counter() - began

    ways = {"plain step": None, "a forward of its own": "0", "riding the next step": "1"}
    spent: dict[str, list[float]] = {way: [] for way in ways}
    run = fresh()
    for i in range(args.joins):
        if any(run.rows[b].stopper.remaining < 120 for b in run.active):
            run = fresh()
        prompt = ids[8 + i % (len(ids) - 8)]
        for way in (list(ways) if i % 2 else list(ways)[::-1]):
            if ways[way] is None:
                spent[way].append(timed(run))
                continue
            os.environ["OPTTREE_RIDE"] = ways[way]
            plain = statistics.median(spent["plain step"][-5:]) if spent["plain step"] else 0.0
            began = time.perf_counter()
            b = speculator.admit(run, opttree.Request(prompt))
            cost, steps = time.perf_counter() - began, 0
            while b not in run.active:
                cost, steps = cost + timed(run), steps + 1
            spent[way].append(cost - steps * plain)
            run.cancel(b)
            timed(run)
    os.environ.pop("OPTTREE_RIDE")
    print(f"8 rows, budget {args.budget}, {args.dtype}, {args.device}, {args.joins} joins each way")
    print("| | ms (median) |\n|---|---:|")
    for way, seconds in spent.items():
        print(f"| {way}{' (its time)' if way == 'plain step' else ' (beyond plain steps)'} | "
              f"{1e3 * statistics.median(seconds):.1f} |")


def stack_cost(target) -> None:
    """`stack_rows` of 8 prefilled rows and a joining one, as `Generation` makes a batch's cache when a row joins."""
    def prefilled(length: int):
        cache = new_cache(target)
        target(input_ids=torch.randint(10, 1000, (1, length), device=target.device), **{cache_argument(target): cache})
        return cache

    with torch.inference_mode():
        lengths = [180 + 7 * i for i in range(8)]
        rows = [prefilled(n) for n in lengths]
        joining = prefilled(120)
        anew, roomy = stack_rows([(r, [n]) for r, n in zip(rows, lengths)], torch.float32), None
        spent: dict[str, list[float]] = {"stacked anew": [], "written into room for 9 rows": []}
        for i in range(31):
            roomy = roomy or stack_rows([(r, [n]) for r, n in zip(rows, lengths)], torch.float32, rows_room=9)
            for way in (list(spent) if i % 2 else list(spent)[::-1]):
                began = time.perf_counter()
                if way == "stacked anew":
                    stack_rows([(anew, lengths), (joining, [120])], torch.float32)
                else:
                    stack_rows([(roomy, lengths), (joining, [120])], torch.float32, rows_room=9)
                spent[way].append(time.perf_counter() - began)
            select_rows(roomy, list(range(8)), lengths)  # the joining row leaves again (in place: the room stays)
    for way, seconds in spent.items():
        print(f"stack_rows, 8 rows of 180-229 positions and one of 120, float32, {way}: "
              f"{1e3 * statistics.median(seconds[1:]):.2f} ms")


if __name__ == "__main__":
    main()
