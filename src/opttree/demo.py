"""The embedded default pair (trained by `opttree train pair`, shipped packed: `opttree.shipped`): where it
is unpacked and how to load it."""

from __future__ import annotations

from pathlib import Path

import torch

from .shipped import shipped_path


def demo_paths() -> tuple[Path, Path]:
    """The folders of the shipped target and draft (unpacked into the user cache on first use)."""
    return shipped_path("target"), shipped_path("draft")


def load_model(path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", tp_plan: str | None = None):
    """A causal LM from a local directory (never the Hub), with an attention implementation that
    takes tree masks (sdpa or eager); `tp_plan="auto"` shards it over the ranks (`opttree.parallel`)."""
    from transformers import AutoModelForCausalLM

    sharding = {}
    if tp_plan:
        try:  # transformers >= 5.13 takes the plan in a DistributedConfig, older ones as a keyword
            from transformers import DistributedConfig

            sharding = {"distributed_config": DistributedConfig(tp_plan=tp_plan)}
        except ImportError:
            sharding = {"tp_plan": tp_plan}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                local_files_only=True, **sharding).eval()


def demo_models(dtype: torch.dtype = torch.bfloat16):
    """(target, draft, tokenizer) of the shipped pair, loaded from inside the package (no download)."""
    from transformers import AutoTokenizer

    target_path, draft_path = demo_paths()
    return load_model(target_path, dtype), load_model(draft_path, dtype), AutoTokenizer.from_pretrained(target_path)
