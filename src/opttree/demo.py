"""The embedded default pair (trained by `opttree train pair`) and the `opttree demo` command."""

from __future__ import annotations

from pathlib import Path

import torch

MODELS_DIR = Path(__file__).parent / "models"
DEMO_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n",
]


def demo_paths() -> tuple[Path, Path]:
    target, draft = MODELS_DIR / "target", MODELS_DIR / "draft"
    for path in (target, draft):
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"the shipped model pair is missing ({path}); reinstall opttree or rebuild it with "
                "`opttree train pair` (see docs/TRAINING.md)"
            )
    return target, draft


def load_model(path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """A causal LM from a local directory (never the Hub), with an attention implementation that
    takes tree masks (sdpa or eager)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                local_files_only=True).eval()


def demo_models(dtype: torch.dtype = torch.bfloat16):
    """(target, draft, tokenizer) of the shipped pair, loaded from inside the package (no download)."""
    from transformers import AutoTokenizer

    target_path, draft_path = demo_paths()
    return load_model(target_path, dtype), load_model(draft_path, dtype), AutoTokenizer.from_pretrained(target_path)


def run_demo(args) -> int:
    """`opttree demo`: complete a few code prompts with OPT-Tree and with plain decoding, interleaved."""
    import json

    from .cli import load_pair, tree_options
    from .engine import generate

    target, draft, tokenizer = load_pair(args)
    tree = tree_options(args, target, draft)
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, eos_token_id=tokenizer.eos_token_id)
    methods = {"ar": dict(tree="ar"),
               args.tree: tree}
    prompts = [tokenizer(p, return_tensors="pt").input_ids for p in DEMO_PROMPTS]
    generate(target, prompts[0], draft, **methods[args.tree], **{**common, "max_new_tokens": 8})  # warm-up
    totals = {name: {"tokens": 0, "steps": 0, "time": 0.0} for name in methods}
    same = 0
    for text, ids in zip(DEMO_PROMPTS, prompts):
        outputs = {}
        for name, method in methods.items():
            out = generate(target, ids, draft, **method, **common)
            outputs[name] = out
            totals[name]["tokens"] += out.stats.new_tokens
            totals[name]["steps"] += out.stats.steps
            totals[name]["time"] += out.stats.time_s
        same += torch.equal(outputs["ar"].sequences, outputs[args.tree].sequences)
        if not args.json:
            print(f"--- {args.tree} (mean accepted length {outputs[args.tree].stats.mean_accepted_length:.2f}) ---")
            print(text + tokenizer.decode(outputs[args.tree].new_tokens))
    rows = []
    ar_speed = totals["ar"]["tokens"] / totals["ar"]["time"]
    for name, t in totals.items():
        speed = t["tokens"] / t["time"]
        rows.append({"method": name, "mean_accepted_length": t["tokens"] / t["steps"], "tokens_per_second": speed,
                     "speedup": speed / ar_speed})
    if args.json:
        print(json.dumps({"rows": rows, "identical_to_ar": same, "prompts": len(prompts), "budget": tree["budget"]}))
        return 0
    print(f"\n{'method':<10}{'accepted/step':>15}{'tokens/s':>12}{'speedup':>10}")
    for r in rows:
        print(f"{r['method']:<10}{r['mean_accepted_length']:>15.2f}{r['tokens_per_second']:>12.1f}{r['speedup']:>9.2f}x")
    print(f"\n{same}/{len(prompts)} completions identical to plain decoding "
          f"({args.dtype}, temperature {args.temperature}, budget {tree['budget']}, delta {tree['delta']:g}, "
          f"draft temperature {tree['draft_temperature']:.2g})")
    if args.temperature > 0:
        print("(sampling: the outputs follow the target's distribution exactly; the same tokens as plain "
              "decoding are not guaranteed at temperature > 0)")
    elif same < len(prompts) and args.dtype not in ("float32", "fp32"):
        print(f"({args.dtype} rounds a forward over a tree differently from a one-token forward, so near-ties can "
              "flip; --dtype float32 is the exact reference, token for token)")
    return 0
