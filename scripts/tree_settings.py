"""Tree settings side by side, interleaved per prompt (the order rotated): mean accepted length, tokens/s,
speedup over plain decoding and draft time per step, for settings `opttree bench` cannot vary per method
(max depth, delta, draft temperature). The shipped pair in float32 (or --dtype bfloat16); the draft model is
passed to the settings whose drafter uses it, the shipped feature head to those naming `head`.

    python scripts/tree_settings.py --first 40 --count 16 --max-new-tokens 64 --temperature 1 \\
        'tree=opt budget=8' 'tree=opt budget=4 max_depth=4' 'tree=opt budget=8 draft_temperature=0.7'
    python scripts/tree_settings.py --prompts examples/heldout-code.jsonl --count 23 --max-new-tokens 128 \\
        --temperature 0 --dtype bfloat16 'drafter=lookup budget=16 delta=0.1' 'drafter=lookup budget=16 delta=0.6'
    python scripts/tree_settings.py --temperature 1 'tree=opt budget=8' 'tree=opt budget=8 draft=runs/draft/final'

`draft=FOLDER`: that setting drafts with the draft model saved there (loaded once) instead of the shipped one;
`draft_dtype=float32` (or bfloat16): with the draft (that one or the shipped one) in that dtype;
`acceptance=0.66,0.1,0.06`: the acceptance vector by draw rank (Sequoia's, and sampled children's p-hat).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM

import opttree
from opttree.parts import shipped_part
from opttree.settings.drafter_spec import DrafterSpec


def setting(text: str) -> dict:
    """'tree=opt budget=4 delta=0.3' -> {'tree': 'opt', 'budget': 4, 'delta': 0.3}."""
    options = {}
    for item in text.split():
        key, _, value = item.partition("=")
        if key == "acceptance":  # acceptance=0.66,0.1,0.06: by draw rank
            options[key] = tuple(float(v) for v in value.split(","))
        else:
            options[key] = value if key in ("tree", "drafter", "children", "draft", "draft_dtype") else \
                (float(value) if "." in value else int(value))
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="+", help="'key=value ...' of opttree.generate's settings")
    parser.add_argument("--prompts", default="../shared/data/humaneval.jsonl")
    parser.add_argument("--first", type=int, default=0, help="index of the first prompt")
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    target, draft, tok = opttree.demo_models(getattr(torch, args.dtype))
    head = shipped_part("head", target)
    drafts = {}  # (folder, dtype) -> the draft model saved there, in that dtype

    def call(options: dict) -> tuple:
        """The draft argument and the options of one setting, as generate takes them, and which draft it is."""
        folder, dtype = options.pop("draft", None), options.pop("draft_dtype", args.dtype)
        chosen = None  # the shipped draft in --dtype
        if folder is not None or dtype != args.dtype:
            chosen = (folder or str(opttree.shipped_path("draft")), dtype)
            if chosen not in drafts:
                drafts[chosen] = AutoModelForCausalLM.from_pretrained(chosen[0], dtype=getattr(torch, dtype)).eval()
        drafter = DrafterSpec.parse(options["drafter"]) if "drafter" in options else None
        uses_draft = options.get("tree") != "ar" and (drafter is None or drafter.uses_draft_model)
        extra = {"head": head} if drafter is not None and "head" in drafter else {}
        return (drafts.get(chosen, draft) if uses_draft else None), {**options, **extra}, chosen

    runs = [call({"tree": "ar"})] + [call(setting(s)) for s in args.settings]
    for run_draft, options, _ in runs:  # probes and first calls out of the timing
        opttree.generate(target, tok("def f(x):", return_tensors="pt").input_ids, run_draft, max_new_tokens=8,
                         temperature=args.temperature, **options)
    lines = open(args.prompts).read().splitlines()[args.first : args.first + args.count]
    totals = [[0, 0, 0.0, 0.0] for _ in runs]  # new tokens, steps, seconds, draft seconds
    for j, line in enumerate(lines):
        ids = tok(json.loads(line)["prompt"], return_tensors="pt").input_ids
        for i in [(j + k) % len(runs) for k in range(len(runs))]:  # rotated order per prompt
            run_draft, options, _ = runs[i]
            start = time.perf_counter()
            out = opttree.generate(target, ids, run_draft, eos_token_id=[], seed=j, max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, **options)
            stats = out.stats
            totals[i] = [a + b for a, b in zip(totals[i], (stats.new_tokens, stats.steps, time.perf_counter() - start,
                                                            stats.draft_s))]
    plain = totals[0][0] / totals[0][2]
    for (_, options, chosen), (new, steps, seconds, draft_s) in zip(runs, totals):
        shown = {k: v for k, v in options.items() if k != "head"} | ({"draft": "@".join(chosen)} if chosen else {})
        print(f"{shown}: MAL {new / steps:.2f}, {new / seconds:.1f} tokens/s, {new / seconds / plain:.2f}x, "
              f"draft {1e3 * draft_s / steps:.1f} ms/step")


if __name__ == "__main__":
    main()
