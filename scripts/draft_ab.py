"""Two draft models against each other and plain decoding, in one process, prompt by prompt (the order alternated):
the shipped draft (or --old DIR) against a draft folder, both with the settings the calibration profile gives the
shipped draft (`opttree.profile_options`) and the --settings given; the shipped target, bf16, seed 0.

    python scripts/draft_ab.py runs/draft-sd/final --per-category 2 --temperature 0.7          # Spec-Bench, chain of 3
    python scripts/draft_ab.py runs/draft-sd/final --prompts ../shared/data/humaneval.jsonl --limit 40 \\
        --temperature 1 --settings "tree='opt'"
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from ab_versions import print_totals  # this folder's: the same table
from transformers import AutoModelForCausalLM

import opttree
from opttree.bench.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("new", type=Path, help="a draft model folder")
    parser.add_argument("--old", type=Path, default=None, help="the draft to compare with (default: the shipped one)")
    parser.add_argument("--prompts", type=Path, default=ROOT.parent / "shared/data/spec_bench_questions.jsonl")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--per-category", type=int, default=None, help="prompts a category (Spec-Bench)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--settings", default="tree='chain', budget=3", help="generate keywords, Python syntax")
    args = parser.parse_args()
    target, shipped, tokenizer = opttree.demo_models(dtype=torch.bfloat16)
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()  # noqa: E731
    old = shipped if args.old is None else load(args.old)
    new = load(args.new)
    settings = eval(f"dict({args.settings})")  # noqa: S307 -- a developer's command line
    options = dict(opttree.profile_options(target, shipped, tree=settings.get("tree", "opt"),
                                           temperature=args.temperature)) if args.temperature > 0 else {}
    options.update(settings)
    texts = load_prompts(args.prompts, limit=args.limit, per_category=args.per_category)
    prompts = [tokenizer(p.text, return_tensors="pt").input_ids for p in texts]
    cells = [("old draft", old), ("new draft", new), ("plain decoding", None)]

    def run(draft, ids) -> tuple[float, int, int]:
        start = time.perf_counter()
        result = opttree.generate(target, ids, draft, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  seed=0, **(options if draft is not None else dict(tree="ar")))
        return time.perf_counter() - start, len(result.new_tokens), result.stats.steps

    for _, draft in cells:  # warm-up
        run(draft, prompts[0])
    totals = {label: [0.0, 0, 0] for label, _ in cells}  # seconds, tokens, steps
    for i, ids in enumerate(prompts):
        for label, draft in cells if i % 2 == 0 else cells[::-1]:
            totals[label] = [a + b for a, b in zip(totals[label], run(draft, ids))]
        print(f"prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    print(f"\n{options}, temperature {args.temperature}, {len(prompts)} prompts, {args.max_new_tokens} new tokens\n")
    print_totals(totals, "draft")


if __name__ == "__main__":
    main()
