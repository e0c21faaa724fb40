"""How well the draft guesses the target over windows of the last positions (`draft_window`), by Spec-Bench category.

For each prompt the target writes 128 tokens (sampled at --temperature, greedy at 0); then, at every written
position, the draft's next-token distribution from the whole context and from its last W positions (its own
forward, float32, positions kept absolute) is compared with the target's: at temperature T > 0 the probability that
a token drawn from the draft is accepted by rejection sampling, sum over x of min(p(x), q(x)), p the target's and q
the draft's distribution at T (as a sampled tree draws its children: the draft's logits divided by T and by
--draft-temperature, 1 as the calibration chose for sampling here); at 0, whether the draft's top token is the
target's. Prompts 6-7 of each category (a benchmark's `--per-category 2`
takes the first two).

    python scripts/draft_window.py --temperature 0.7
    python scripts/draft_window.py --temperature 0 --windows 0,512,256,128
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

import opttree
from opttree.bench.prompts import encode, load_prompts


def draft_logits(draft, sequence: torch.Tensor, start: int, window: int) -> torch.Tensor:
    """(N, V) the draft's next-token logits after each of sequence[:, start-1 : -1], over the whole context
    (window 0) or over the last `window` positions."""
    if not window:
        return draft(sequence).logits[0, start - 1 : -1].float()
    rows = []
    for end in range(start, sequence.shape[1]):
        first = max(0, end - window)
        rows.append(draft(sequence[:, first:end], position_ids=torch.arange(first, end)[None]).logits[0, -1].float())
    return torch.stack(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="../shared/data/spec_bench_questions.jsonl")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--windows", default="0,384,256,192,128,96", help="0: the whole context")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-temperature", type=float, default=1.0)
    args = parser.parse_args()
    windows = [int(w) for w in args.windows.split(",")]
    torch.manual_seed(0)
    target, draft, tokenizer = opttree.demo_models(dtype=torch.float32)
    by_category = defaultdict(list)
    for prompt in load_prompts(args.prompts, per_category=100):
        by_category[prompt.category].append(prompt)
    scores = defaultdict(lambda: defaultdict(list))  # category -> window -> per prompt
    sampled = args.temperature > 0
    for category in sorted(by_category):
        for prompt in by_category[category][5:7]:
            ids = encode(tokenizer, prompt)
            start = ids.shape[1]
            with torch.inference_mode():
                sequence = target.generate(ids, do_sample=sampled, temperature=args.temperature if sampled else None,
                                           top_k=None, max_new_tokens=args.max_new_tokens)
                logits = target(sequence).logits[0, start - 1 : -1].float()  # (N, V)
                for window in windows:
                    guess = draft_logits(draft, sequence, start, window)  # (N, V)
                    if sampled:
                        p = torch.softmax(logits / args.temperature, dim=-1)
                        q = torch.softmax(guess / (args.temperature * args.draft_temperature), dim=-1)
                        score = torch.minimum(p, q).sum(-1).mean()
                    else:
                        score = (guess.argmax(-1) == logits.argmax(-1)).float().mean()
                    scores[category][window].append(float(score))
    label = "acceptance of a draft draw" if sampled else "top-1 agreement"
    print(f"{label}, temperature {args.temperature:g}, window 0 = the whole context\n")
    print("| category | prompt tokens | " + " | ".join(f"W={w}" for w in windows) + " |")
    print("|---|---:|" + "---:|" * len(windows))
    for category in sorted(scores):
        lengths = [encode(tokenizer, p).shape[1] for p in by_category[category][5:7]]
        print(f"| {category} | {min(lengths)}-{max(lengths)} | "
              + " | ".join(f"{sum(v) / len(v):.3f}" for v in scores[category].values()) + " |")
    mean = {w: sum(sum(s[w]) for s in scores.values()) / sum(len(s[w]) for s in scores.values()) for w in windows}
    print("| all | | " + " | ".join(f"**{mean[w]:.3f}**" for w in windows) + " |")


if __name__ == "__main__":
    main()
