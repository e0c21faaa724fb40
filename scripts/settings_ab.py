"""Several generate settings of this checkout against each other and plain decoding, in one process, prompt by
prompt (the order rotated per prompt): for comparisons `opttree bench` cannot make in one run, such as an
environment switch (`OPTTREE_BLOCK=0`: chains verified token by token) or a class switch
(`DySpec.grow_on_device`). Each variant is LABEL=SETTINGS, SETTINGS being generate keywords in Python syntax
plus, optionally, `env={...}` (set for that variant's runs only) and `dyspec_on_device=True`; a sampled run
starts from the pair's profile settings (`opttree.profile_options`), which a variant's keywords override.

    python scripts/settings_ab.py --temperature 1 "chain-top=tree='chain', budget=3, children='top'" \\
        "chain-token=tree='chain', budget=3, env={'OPTTREE_BLOCK': '0'}" "chain-block=tree='chain', budget=3"
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from ab_versions import print_totals  # this folder's: the same table

import opttree
from opttree.bench.prompts import load_prompts
from opttree.step.drafters.estimates import kept_apart
from opttree.step.policies.dyspec import DySpec

ROOT = Path(__file__).resolve().parents[1]


def parse_variant(text: str) -> tuple[str, dict]:
    label, _, settings = text.partition("=")
    return label, eval(f"dict({settings})")  # noqa: S307 -- a developer's command line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", help="LABEL=SETTINGS (module docstring)")
    parser.add_argument("--prompts", type=Path, default=ROOT.parent / "shared/data/humaneval.jsonl")
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--per-category", type=int, default=None, help="prompts a category (Spec-Bench)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    target, draft, tokenizer = opttree.demo_models(dtype=getattr(torch, args.dtype))
    texts = load_prompts(args.prompts, limit=args.limit, per_category=args.per_category)
    prompts = [tokenizer(p.text, return_tensors="pt").input_ids for p in texts]
    base = opttree.profile_options(target, draft, temperature=args.temperature)
    variants = [("plain decoding", {"tree": "ar"})] + [parse_variant(v) for v in args.variants]
    learnt = {label: {} for label, _ in variants}  # what each variant's train-free sources learn: its own

    def run(settings: dict, ids: torch.Tensor, seed: int, states: dict) -> list:
        """[seconds, new tokens, steps] of one generation with `settings`, learning into `states`."""
        settings = dict(settings)
        env, DySpec.grow_on_device = settings.pop("env", {}), settings.pop("dyspec_on_device", False)
        plain = settings.get("tree") == "ar"
        os.environ.update(env)
        try:
            start = time.perf_counter()
            options = settings if plain else {**base, **settings}
            uses_draft = not plain and "model" in str(options.get("drafter") or "model")
            if not uses_draft:  # train-free sources: no draft model, no draft temperature
                options = {k: v for k, v in options.items() if k != "draft_temperature"}
            with kept_apart(target, states):
                stream = opttree.stream(target, ids, draft if uses_draft else None, max_new_tokens=args.max_new_tokens,
                                        temperature=args.temperature, seed=seed, **options)
                tokens = sum(chunk.numel() for chunk in stream)
            return [time.perf_counter() - start, tokens, stream.stats.steps]
        finally:
            for key in env:
                os.environ.pop(key)
            DySpec.grow_on_device = False

    for _, settings in variants:  # warm-up (what it teaches is dropped)
        run(settings, prompts[0], 0, {})
    totals = {label: [0.0, 0, 0] for label, _ in variants}  # seconds, new tokens, steps
    for i, ids in enumerate(prompts):
        for label, settings in variants[i % len(variants):] + variants[: i % len(variants)]:
            totals[label] = [a + b for a, b in zip(totals[label], run(settings, ids, i, learnt[label]))]
    print_totals(totals, "setting")


if __name__ == "__main__":
    main()
