"""What a forward with fewer ops gains: each method with it and without it, interleaved prompt by prompt,
and transformers' own greedy decoding beside them. `--switch lean`: the lean tree forward of target and
draft (`opttree.step.lean`, off: `OPTTREE_LEAN=0`), the same tokens either way (checked); `--switch draft`:
the draft's own (`opttree.step.draft_forward`, off: `OPTTREE_DRAFT_FORWARD=0`), the same tokens at
temperature 0 (checked; when sampling, other draws of the same distribution). When sampling, a method that
drafts with the draft model takes the pair's profile settings (`opttree.profile_options`) unless given.

    python scripts/lean_forward.py                       # shipped pair, bf16, HumanEval 20, 128 new tokens
    python scripts/lean_forward.py --limit 10 --temperature 1 --methods ar,opt:model@16
    python scripts/lean_forward.py --switch draft --limit 40 --temperature 1 --methods ar,opt@8
    python scripts/lean_forward.py --prefill --limit 40    # the prompts' prefills alone (the engine's `prefill_s`)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

import opttree
from opttree.bench.prompts import load_prompts


SWITCHES = {"lean": "OPTTREE_LEAN", "draft": "OPTTREE_DRAFT_FORWARD"}


def run(method: str, target, draft, ids: torch.Tensor, args) -> tuple[list[int], float, int]:
    """(new tokens, seconds, steps) of one generation."""
    start = time.perf_counter()
    if method == "hf-ar":
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                              do_sample=False)
        return out[0, ids.shape[1]:].tolist(), time.perf_counter() - start, out.shape[1] - ids.shape[1]
    name, _, budget = method.partition("@")
    policy, _, drafter = name.partition(":")
    uses_draft = policy != "ar" and (not drafter or "model" in drafter)
    options = {}
    if uses_draft and args.temperature > 0:
        options.update(opttree.profile_options(target, draft, tree=policy, temperature=args.temperature))
    options.update(tree=policy, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
    if drafter:
        options.update(drafter=drafter)
    if budget or drafter:
        options.update(budget=int(budget or 16))
    result = opttree.generate(target, ids, draft if uses_draft else None, **options)
    return result.new_tokens.tolist(), time.perf_counter() - start, result.stats.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, default=Path(__file__).parents[2] / "shared/data/humaneval.jsonl")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--methods", default="ar,opt:model@16,opt:recycling+lookup@16,hf-ar")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--switch", default="lean", choices=list(SWITCHES), help="which forward is turned on and off")
    parser.add_argument("--prefill", action="store_true", help="time the prompts' prefills only (lean on and off)")
    args = parser.parse_args()
    variable = SWITCHES[args.switch]
    target, draft, tokenizer = opttree.demo_models(dtype=getattr(torch, args.dtype))
    prompts = [tokenizer(p.text, return_tensors="pt").input_ids for p in load_prompts(args.prompts, limit=args.limit)]
    if args.prefill:
        return prefills(target, prompts)
    methods = args.methods.split(",")
    cells = [(m, lean) for m in methods for lean in (("on", "off") if m != "hf-ar" else ("-",))]
    tokens = {cell: 0 for cell in cells}
    seconds = {cell: 0.0 for cell in cells}
    steps = {cell: 0 for cell in cells}
    differ = {m: 0 for m in methods}
    for method in methods:  # warm-up
        run(method, target, draft, prompts[0], args)
    for i, ids in enumerate(prompts):
        outputs = {}
        order = cells if i % 2 == 0 else cells[::-1]
        for method, lean in order:
            os.environ[variable] = "0" if lean == "off" else "1"
            out, s, k = run(method, target, draft, ids, args)
            outputs[method, lean] = out
            tokens[method, lean] += len(out)
            seconds[method, lean] += s
            steps[method, lean] += k
        for method in methods:
            if method != "hf-ar" and outputs[method, "on"] != outputs[method, "off"]:
                differ[method] += 1
        print(f"prompt {i + 1}/{len(prompts)}", flush=True)
    os.environ.pop(variable)
    print(f"\n| method | {args.switch} forward | tokens/s | ms per step | on / off | outputs that differ |")
    print("|---|---|---:|---:|---:|---:|")
    for method, lean in cells:
        rate = tokens[method, lean] / seconds[method, lean]
        ratio = f"{rate / (tokens[method, 'off'] / seconds[method, 'off']):.2f}x" if lean == "on" else ""
        print(f"| {method} | {lean} | {rate:.1f} | {seconds[method, lean] / steps[method, lean] * 1e3:.2f} | {ratio} | "
              f"{differ[method] if lean == 'on' else ''} |")


def prefills(target, prompts: list[torch.Tensor], repeats: int = 3) -> None:
    """Each prompt's prefill with the lean forward on and off, alternated (`repeats` times, the median), as the
    engine times it (`stats.prefill_s` of a one-token greedy generation); the medians by prompt length."""
    times: dict[str, list[tuple[int, float]]] = {"on": [], "off": []}
    for i, ids in enumerate([prompts[0]] + prompts):  # the first: a warm-up
        seconds: dict[str, list[float]] = {"on": [], "off": []}
        for repeat in range(repeats):
            for lean in ("on", "off") if (i + repeat) % 2 else ("off", "on"):
                os.environ["OPTTREE_LEAN"] = "1" if lean == "on" else "0"
                seconds[lean].append(opttree.generate(target, ids, max_new_tokens=1, tree="ar").stats.prefill_s)
        for lean, measured in seconds.items():
            if i:
                times[lean].append((ids.shape[1], statistics.median(measured)))
    os.environ.pop("OPTTREE_LEAN")
    print("| prompt tokens | prompts | prefill ms, lean forward | prefill ms, the model's forward | on / off |")
    print("|---|---:|---:|---:|---:|")
    for low, high in ((1, 64), (65, 128), (129, 10**9)):
        on = [s for n, s in times["on"] if low <= n <= high]
        off = [s for n, s in times["off"] if low <= n <= high]
        if on:
            span = f"{low}-{high}" if high < 10**9 else f"{low}+"
            print(f"| {span} | {len(on)} | {1e3 * statistics.median(on):.1f} | {1e3 * statistics.median(off):.1f} | "
                  f"{statistics.median(on) / statistics.median(off):.2f} |")


if __name__ == "__main__":
    main()
