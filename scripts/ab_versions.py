"""This checkout's opttree against an earlier revision's, in one process, prompt by prompt (the order alternated),
with plain decoding beside them: what a change gains on a machine whose speed drifts between runs.

The revision's `src/opttree` is extracted (`git archive`) into a temporary folder as the package `opttree_<rev>`
(opttree's own imports are relative, so it runs as it was); both drive the same models (the shipped pair).
Settings are `generate` keywords; a sampled run takes the pair's profile settings (`opttree.profile_options`)
unless given, budget 8 by default.

    python scripts/ab_versions.py 88942f2                             # HumanEval 40, T=1, opt
    python scripts/ab_versions.py HEAD~1 --temperature 0 --limit 20 --settings "tree='opt', budget=16"
    python scripts/ab_versions.py HEAD~1 --temperature 0 --settings "drafter='recycling+lookup'"
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import opttree
from opttree.bench.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[1]


def load_revision(rev: str, folder: Path):
    """The package `src/opttree` of git revision `rev`, importable as opttree_<rev>."""
    name = "opttree_" + "".join(c if c.isalnum() else "_" for c in rev)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src/opttree"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    (folder / "src" / "opttree").rename(folder / name)
    sys.path.insert(0, str(folder))
    return importlib.import_module(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", help="the git revision to compare with (e.g. HEAD~1)")
    parser.add_argument("--prompts", type=Path, default=ROOT.parent / "shared/data/humaneval.jsonl")
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--per-category", type=int, default=None, help="prompts a category (Spec-Bench)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--settings", default="tree='opt'", help="generate keywords, Python syntax")
    args = parser.parse_args()
    settings = eval(f"dict({args.settings})")  # noqa: S307 -- a developer's command line
    target, draft, tokenizer = opttree.demo_models(dtype=getattr(torch, args.dtype))
    texts = load_prompts(args.prompts, limit=args.limit, per_category=args.per_category)
    prompts = [tokenizer(p.text, return_tensors="pt").input_ids for p in texts]
    with tempfile.TemporaryDirectory() as folder:
        old = load_revision(args.rev, Path(folder))
        cells = [("this checkout", opttree, True), (args.rev, old, True), ("plain decoding", opttree, False)]

        def run(module, ids, tree: bool) -> tuple[float, int, int]:
            options = dict(tree="ar")
            if tree:
                options = dict(module.profile_options(target, draft, tree=settings.get("tree", "opt"),
                                                      temperature=args.temperature)) if args.temperature > 0 else {}
                options.setdefault("budget", 8)
                options.update(settings)
            uses_draft = tree and "model" in options.get("drafter", "model")  # train-free drafters take none
            start = time.perf_counter()
            result = module.generate(target, ids, draft if uses_draft else None, max_new_tokens=args.max_new_tokens,
                                     temperature=args.temperature, seed=args.seed, **options)
            return time.perf_counter() - start, len(result.new_tokens), result.stats.steps

        for _, module, tree in cells:  # warm-up
            run(module, prompts[0], tree)
        totals = {label: [0.0, 0, 0] for label, _, _ in cells}  # seconds, tokens, steps
        for i, ids in enumerate(prompts):
            for label, module, tree in cells if i % 2 == 0 else cells[::-1]:
                totals[label] = [a + b for a, b in zip(totals[label], run(module, ids, tree))]
            print(f"prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    print(f"\n{args.settings}, temperature {args.temperature}, {args.dtype}, {len(prompts)} prompts, "
          f"{args.max_new_tokens} new tokens\n")
    print_totals(totals, "code")


def print_totals(totals: dict[str, list], what: str) -> None:
    """A markdown table of {label: [seconds, new tokens, steps]}, speedups over the row "plain decoding"."""
    plain = totals["plain decoding"][1] / totals["plain decoding"][0]
    print(f"| {what} | tokens/s | mean accepted length | ms a step | speedup over plain decoding |")
    print("|---|---:|---:|---:|---:|")
    for label, (seconds, tokens, steps) in totals.items():
        print(f"| {label} | {tokens / seconds:.1f} | {tokens / steps:.3f} | {seconds / steps * 1e3:.2f} | "
              f"{tokens / seconds / plain:.3f}x |")


if __name__ == "__main__":
    main()
