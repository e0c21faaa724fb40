"""Structured outputs: answers held to a JSON schema, opttree's methods against transformers' `generate` with the same
grammar (the same `opttree.grammar.Constraint` as its logits processor), interleaved prompt by prompt.

    python scripts/structured_bench.py --dtype bfloat16 --limit 20 --max-new-tokens 96

The shipped pair; each HumanEval prompt is followed by a request to describe the function as JSON, and the answer is
held to SCHEMA. Every opttree answer is compared with `generate`'s (equal in float32; bfloat16 rounds a tree forward
unlike a one-token one; `--temperature T`: every method samples, top-k off, and answers differ). Also reported: the
same methods with no grammar, on the same prompts (other text, so other acceptance), and with the grammar but the
draft left unheld (`HeldDrafter` off), to show what holding the draft gives.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import opttree
from opttree.grammar import Constraint, json_schema
from opttree.step.drafters.held import HeldDrafter

SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 24}, "path": {"type": "string", "maxLength": 40},
                         "line": {"type": "integer"}, "public": {"type": "boolean"},
                         "arguments": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4}},
          "required": ["name", "path", "line", "public", "arguments"]}
ASK = "\n# the function above, described as JSON:\n# "


def methods(target, draft, tok, n: int, temperature: float):
    """name -> run(ids, constraint or None, seed) -> (new token ids, steps)."""
    sampling = dict(do_sample=True, temperature=temperature, top_k=0) if temperature > 0 else dict(do_sample=False)

    def hf(**kw):
        def run(ids, held, seed):
            torch.manual_seed(seed)
            with torch.inference_mode():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                      logits_processor=[held] if held else None, **sampling, **kw)
            new = out[0, ids.shape[1]:].tolist()
            return new, len(new)
        return run

    def ours(with_draft: bool, **kw):
        def run(ids, held, seed):
            out = opttree.generate(target, ids, draft if with_draft else None, max_new_tokens=n, seed=seed,
                                   temperature=temperature, top_k=0, logits_processor=[held] if held else None, **kw)
            return out.new_tokens.tolist(), out.stats.steps
        return run

    return {"hf-ar": hf(), "hf-lookup": hf(prompt_lookup_num_tokens=10), "hf-assisted": hf(assistant_model=draft),
            "ar": ours(False, tree="ar"), "opt (draft model, defaults)": ours(True),
            "chain:model@4": ours(True, tree="chain", budget=4),
            "opt:recycling+lookup (no draft, defaults)": ours(False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[2] / "shared/data/humaneval.jsonl"))
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=1, help="timed rounds after one untimed warm-up round")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: every method samples (answers then differ)")
    args = ap.parse_args()
    target, draft, tok = opttree.demo_models(getattr(torch, args.dtype))
    grammar = json_schema(SCHEMA)
    runs = methods(target, draft, tok, args.max_new_tokens, args.temperature)
    cases = [(name, "grammar") for name in runs] + [(name, "no grammar") for name in runs]
    cases += [(name, "grammar, draft unheld") for name in runs if not name.startswith(("hf-", "ar"))]
    prompts = [json.loads(line)["prompt"] + ASK for line in open(args.prompts)][: args.limit]
    totals = {case: [0, 0, 0.0] for case in cases}  # tokens, steps, seconds
    same = {case: 0 for case in cases}
    whole = 0
    original = HeldDrafter._held
    for rnd in range(args.rounds + 1):
        for seed, p in enumerate(prompts):
            ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids
            reference = {}
            for name, how in cases:
                held = Constraint(tok, grammar, ids.shape[1]) if how != "no grammar" else None
                HeldDrafter._held = original if how != "grammar, draft unheld" else lambda self, logq, paths: logq
                start = time.perf_counter()
                new, steps = runs[name](ids, held, seed)
                seconds = time.perf_counter() - start
                HeldDrafter._held = original
                reference.setdefault(how.split(",")[0], new)  # hf-ar's answer, with and without the grammar
                if rnd:
                    total = totals[(name, how)]
                    total[0], total[1], total[2] = total[0] + len(new), total[1] + steps, total[2] + seconds
                    same[(name, how)] += new == reference[how.split(",")[0]]
                    if (name, how) == ("hf-ar", "grammar"):
                        whole += bool(new) and new[-1] == tok.eos_token_id
    base = {how: totals[("hf-ar", how.split(",")[0])] for _, how in cases}
    print(f"{args.dtype}, temperature {args.temperature}, {len(prompts)} prompts x {args.rounds} round(s), "
          f"{args.max_new_tokens} new tokens at most; "
          f"hf-ar's answers under the grammar that completed it: {whole}/{len(prompts) * args.rounds}")
    print(f"{'method':44s} {'grammar':22s} {'MAL':>5s} {'tokens/s':>9s} {'vs hf-ar':>8s} {'same as hf-ar':>14s}")
    for (name, how), (tokens, steps, seconds) in totals.items():
        speed, ref = tokens / seconds, base[how][0] / base[how][2]
        mal = "-" if name.startswith("hf-") else f"{tokens / steps:.2f}"  # (transformers' steps are not counted)
        print(f"{name:44s} {how:22s} {mal:>5s} {speed:9.1f} {speed / ref:7.2f}x "
              f"{same[(name, how)] if not args.temperature else '-':>8}/{len(prompts) * args.rounds}")


if __name__ == "__main__":
    main()
