"""Host syncs, shape syncs and dispatched ops per decoding step, method by method (`opttree.counters`).

Counted on any device, the CPU included: a host sync is a read of a device value by the host, which on
a GPU stalls the launch queue. Each method generates MAX_NEW_TOKENS tokens of the shipped pair (fp32)
from one HumanEval-style prompt; the prefill and the first step are left out.

    python scripts/count_syncs.py                       # the default methods, the stop decided on the host and on the device
    python scripts/count_syncs.py opt:model@64 dyspec:model@16 --temperature 1 --where
    python scripts/count_syncs.py opt:model@16 opt:model@64 --temperature 0 --compiled   # what a GPU runs

--compiled: both models compiled for the static path (`compile_model`), so the draft drafts in fixed
shapes as on a GPU (counted eagerly: the counter runs compiled code's eager version).
"""

from __future__ import annotations

import argparse
import json

import torch

import opttree
from opttree.counters import count_steps
from opttree.step.drafters.estimates import forget
from opttree.step.policies.dyspec import DySpec
from opttree.step.policies.opt import OptTree

DEFAULT = ["ar", "opt:model@16", "opt:model@64", "opt:head@16", "eagle2:model@16", "dyspec:model@16",
           "opt:recycling+lookup@16", "opt:model+lookup@16"]
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def parse(method: str) -> tuple[str, str | None, int | None]:
    """'POLICY[:DRAFTER][@BUDGET]' -> (policy, drafter, budget)."""
    name, _, budget = method.partition("@")
    policy, _, drafter = name.partition(":")
    return policy, drafter or None, int(budget) if budget else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("methods", nargs="*", default=DEFAULT)
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--where", action="store_true", help="also list the lines of opttree that read the device")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--compiled", action="store_true", help="compile both models for the static path first")
    args = parser.parse_args()
    target, draft, tokenizer = opttree.demo_models(dtype=torch.float32)
    if args.compiled:
        opttree.compile_model(target), opttree.compile_model(draft)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    rows = []
    for temperature in args.temperature:
        for method in args.methods:
            policy, drafter, budget = parse(method)
            for stop in ("host", "device") if policy in ("opt", "dyspec") else ("-",):
                OptTree.stop_on_device = DySpec.grow_on_device = stop == "device"
                forget(target)  # every run starts cold: the train-free sources' state is kept per target
                options = dict(tree=policy, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=0)
                if drafter:
                    options.update(drafter=drafter, budget=budget or 16)
                uses_draft = policy != "ar" and (drafter is None or "model" in drafter)
                run = opttree.stream(target, ids, draft if uses_draft else None, **options)
                costs, counter = count_steps(run, where=args.where)
                rows.append({"method": method, "temperature": temperature, "delta_stop": stop, **costs.as_dict(),
                             "mean_accepted_length": round(run.stats.mean_accepted_length, 2),
                             "where": dict(counter.by_line.most_common(6)) if args.where else None})
    OptTree.stop_on_device = DySpec.grow_on_device = False
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| method | T | stop / growth | MAL | host syncs / step | shape syncs / step | ops / step | machinery ops / step |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {r['temperature']:g} | {r['delta_stop']} | {r['mean_accepted_length']:.2f} | "
              f"{r['host_syncs_per_step']:.2f} | {r['shape_syncs_per_step']:.2f} | {r['ops_per_step']:.0f} | "
              f"{r['machinery_ops_per_step']:.0f} |")
        if r["where"]:
            print("|  | | | | " + "; ".join(f"{k} x{v}" for k, v in r["where"].items()) + " | | | |")


if __name__ == "__main__":
    main()
