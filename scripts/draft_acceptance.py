"""How often a draft token sampled at --temperature is accepted, by Spec-Bench category and on HumanEval, for one or
more draft models, teacher-forced on text the target writes: the target samples 96 tokens after each prompt, and at
every written position sum over x of min(p(x), q(x)) (p the target's distribution, q the draft's, both at T; the
draft over its last 256 positions, float32) is the chance a draft token drawn from q is accepted. Prompts 6-7 of each
Spec-Bench category and HumanEval 41-52 (past what the benchmarks' first prompts use).

    python scripts/draft_acceptance.py shipped runs/draft-sd/final
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch
from draft_window import draft_logits  # this folder's: the draft's next-token logits over its last positions
from transformers import AutoModelForCausalLM

import opttree
from opttree.bench.prompts import encode, load_prompts

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafts", nargs="+", help="draft model folders ('shipped': the shipped draft)")
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    target, _, tokenizer = opttree.demo_models(dtype=torch.float32)
    drafts = {name: AutoModelForCausalLM.from_pretrained(opttree.shipped_path("draft") if name == "shipped" else name,
                                                         dtype=torch.float32).eval() for name in args.drafts}
    by_category = defaultdict(list)
    for prompt in load_prompts(ROOT.parent / "shared/data/spec_bench_questions.jsonl", per_category=100):
        by_category[prompt.category].append(prompt)
    cases = [(c, p) for c in sorted(by_category) for p in by_category[c][5:7]]
    cases += [("humaneval", p) for p in load_prompts(ROOT.parent / "shared/data/humaneval.jsonl", limit=52)[40:52]]
    scores = defaultdict(lambda: defaultdict(list))  # draft -> category -> per prompt
    torch.manual_seed(0)
    with torch.inference_mode():
        for category, prompt in cases:
            ids = encode(tokenizer, prompt)
            start = ids.shape[1]
            sequence = target.generate(ids, do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
                                       max_new_tokens=96, attention_mask=torch.ones_like(ids))
            p = (target(sequence).logits[0, start - 1 : -1].float() / args.temperature).softmax(-1)  # (N, V)
            for name, draft in drafts.items():
                q = (draft_logits(draft, sequence, start, WINDOW) / args.temperature).softmax(-1)  # (N, V)
                scores[name][category].append(torch.minimum(p, q).sum(-1).mean().item())
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    print("| category | " + " | ".join(args.drafts) + " |\n|---|" + "---:|" * len(drafts))
    for category in sorted(by_category) + ["humaneval"]:
        print(f"| {category} | " + " | ".join(f"{mean(scores[n][category]):.3f}" for n in drafts) + " |")
    print("| Spec-Bench mean | " + " | ".join(f"{mean([mean(scores[n][c]) for c in by_category]):.3f}"
                                             for n in drafts) + " |")


if __name__ == "__main__":
    main()
