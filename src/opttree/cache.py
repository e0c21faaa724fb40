"""KV caches: creation, the supported-model check, and compaction to the accepted path.

The layout of `transformers.DynamicCache` (per layer `.keys` / `.values` of shape
(batch, heads, seq, head_dim)) is touched only here.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch
from transformers import DynamicCache, PreTrainedModel

MASKABLE_ATTENTION = ("sdpa", "eager")
ROLLBACK_LAYER_TYPES = ("full_attention", "sliding_attention")
# What a layer type that cannot be driven by tree attention really is (for the refusal's message).
LAYER_KINDS = {
    "linear_attention": "linear attention (a recurrent state)",
    "chunked_attention": "chunked attention (attention restarts every chunk)",
    "indexed_attention": "indexed sparse attention (a learned indexer picks the keys)",
    "compressed_sparse_attention": "compressed sparse attention",
    "heavily_compressed_attention": "compressed attention",
    "mamba": "state-space (Mamba) layers", "conv": "convolution state", "recurrent": "recurrent layers",
}


def new_cache() -> DynamicCache:
    """A cache of plain full-attention layers (sliding windows are checked by `check_model`)."""
    return DynamicCache()


def last_logits_only(model: PreTrainedModel, rows: int = 1) -> dict:
    """Forward kwargs that compute logits for the last `rows` positions only, where the model supports
    it (a prompt's prefill needs few rows of the vocabulary projection, not one per token)."""
    return {"logits_to_keep": rows} if _takes_logits_to_keep(type(model)) else {}


@lru_cache(maxsize=None)
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def cache_len(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def compact(cache: DynamicCache, start: int, keep: torch.Tensor) -> None:
    """Keep positions [0, start) and the rows `start + keep` (moved to start, start + 1, ...); drop the rest.

    keep: (K,) long offsets relative to `start`, increasing. In place; the cache ends at start + K.
    """
    end = start + keep.shape[0]
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        rows = start + keep
        layer.keys[..., start:end, :] = layer.keys[..., rows, :]  # (B, H, K, Dh); the gather copies first
        layer.values[..., start:end, :] = layer.values[..., rows, :]
        layer.keys = layer.keys[..., :end, :]
        layer.values = layer.values[..., :end, :]


def truncate(cache: DynamicCache, length: int) -> None:
    """Drop everything at and after `length`."""
    extra = cache_len(cache) - length
    if extra > 0:
        cache.crop(-extra)


def context_window(model: PreTrainedModel) -> int | None:
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_model(model: PreTrainedModel, role: str, max_len: int) -> None:
    """Refuse, with a clear message, models whose attention or cache the engine cannot drive exactly.

    max_len: the longest sequence this generation can reach (prompt + new tokens).
    """
    if model.device.type == "meta":
        raise ValueError(f"{role} model is on the meta device (its weights are not loaded): load or move it first")
    config = model.config.get_text_config()
    attn = model.config._attn_implementation
    if attn not in MASKABLE_ATTENTION:
        raise ValueError(
            f"{role} model uses attn_implementation={attn!r}, which cannot take the 4D tree attention mask; "
            f"load it with attn_implementation='sdpa' (or 'eager'), or call model.set_attn_implementation('sdpa')"
        )
    layer_types = getattr(config, "layer_types", None) or []
    odd = sorted(set(layer_types) - set(ROLLBACK_LAYER_TYPES))
    if odd:
        kinds = ", ".join(f"{t!r}: {LAYER_KINDS.get(t, 'not plain causal attention')}" for t in odd)
        raise NotImplementedError(
            f"{role} model ({type(model).__name__}) has layers of type {kinds}: tree attention cannot drive them "
            "exactly (or their state cannot be rolled back to the accepted branch), so tree speculation is not "
            "supported for it"
        )
    window = getattr(config, "sliding_window", None)
    uses_window = window is not None and getattr(config, "use_sliding_window", True) is not False
    if layer_types and "sliding_attention" not in layer_types:
        uses_window = False
    if uses_window and max_len > window:
        raise NotImplementedError(
            f"{role} model uses sliding-window attention (window {window}) and this generation reaches "
            f"{max_len} tokens: a sliding-window cache cannot be rolled back to the accepted branch. "
            f"Keep prompt + max_new_tokens <= {window}"
        )
