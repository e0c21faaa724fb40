"""Real window sizes, tiny widths: Gemma 3's 1024-token local layers and gpt-oss's 128-token sliding layers,
generating past twice the window, checked token for token against `target.generate` for every tree policy
and for the train-free sources (fp32). Too slow for CI (Gemma 3: 2,100 tokens per generation).

    python scripts/window_check.py [gemma3_text gpt_oss]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from arch_configs import tiny  # noqa: E402
from helpers import hf_greedy, tiny_model  # noqa: E402

import opttree  # noqa: E402

WINDOWS = {"gemma3_text": 1024, "gpt_oss": 128}
POLICIES = ("opt", "chain", "eagle2", "dyspec", "sequoia", "static")


def check(model_type: str) -> bool:
    window = WINDOWS[model_type]
    new_tokens = 2 * window + 40
    target = tiny(model_type, "eager", sliding_window=window, max_position_embeddings=4 * window)
    prompt = torch.tensor([[1, 5, 7, 9, 11, 13, 4, 8]])
    reference = hf_greedy(target, prompt, new_tokens, eos_token_id=[])
    draft = tiny_model("llama", vocab=target.get_output_embeddings().weight.shape[0], hidden=32, layers=1, seed=3,
                       max_positions=4 * window)
    runs = [(tree, draft) for tree in POLICIES] + [("opt", None)]  # None: recycling+lookup
    ok = True
    for tree, model_draft in runs:
        start = time.perf_counter()
        out = opttree.generate(target, prompt, model_draft, tree=tree, budget=8, max_new_tokens=new_tokens,
                               eos_token_id=[])
        same = torch.equal(out.sequences, reference)
        ok &= same
        name = tree if model_draft is not None else "opt:recycling+lookup"
        print(f"{model_type} window {window}, {new_tokens} new tokens, {name}: "
              f"{'identical' if same else 'DIFFERENT'} (MAL {out.stats.mean_accepted_length:.2f}, "
              f"{time.perf_counter() - start:.0f} s)", flush=True)
    return ok


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_types", nargs="*", metavar="MODEL_TYPE", help=f"of {', '.join(WINDOWS)} (default: both)")
    model_types = parser.parse_args().model_types or list(WINDOWS)
    if unknown := [m for m in model_types if m not in WINDOWS]:
        parser.error(f"unknown model type(s) {', '.join(unknown)}; choose from {', '.join(WINDOWS)}")
    results = [check(model_type) for model_type in model_types]
    sys.exit(0 if all(results) else 1)
