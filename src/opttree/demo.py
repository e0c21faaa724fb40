"""The embedded default pair (trained by `opttree train pair`): where it is and how to load it."""

from __future__ import annotations

from pathlib import Path

import torch

MODELS_DIR = Path(__file__).parent / "models"


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
