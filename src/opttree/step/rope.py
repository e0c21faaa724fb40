"""Rotary embeddings whose factors switch with the sequence length: LongRoPE (Phi-3/3.5/4-mini long context).

transformers picks LongRoPE's short or long factors per forward: long when the forward's largest
position + 1 exceeds `original_max_position_embeddings` (O), for every token of that forward. The
models that ship with LongRoPE (`RECOMPUTING_TYPES`) add a rule to their `generate`: the first time
the sequence outgrows O, the cache is dropped and the whole sequence recomputed with the long factors.
So with plain decoding, the logits at positions below O come from short-factor keys only, and those at
O and past it from long-factor keys only. The engine does the same (`Generation`): while the root is
below O, no tree node reaches O (the depth is capped); when the root reaches O, the target's cache is
recomputed once with the long factors. Other LongRoPE models and dynamic NTK scaling (new factors with
every length) are refused once a generation crosses the threshold (`opttree.certify`).
"""

from __future__ import annotations

# model types whose generate recomputes the cache at the switch (their `prepare_inputs_for_generation`)
RECOMPUTING_TYPES = ("phi3", "phimoe", "phi4_multimodal")


def rope_kinds(config) -> list[tuple[str | None, int | None]]:
    """(rope_type, threshold) of each rope parameter set of a (text) config (one, or one per layer type): the
    threshold is its original_max_position_embeddings, else the config's, else max_position_embeddings."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    sets = params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]
    return [(p.get("rope_type", p.get("type")),
             p.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
             or getattr(config, "max_position_embeddings", None)) for p in sets]


def longrope_threshold(config) -> int | None:
    """O of a LongRoPE (text) config, else None."""
    return next((int(threshold) for kind, threshold in rope_kinds(config) if kind == "longrope"), None)


def rope_switch(config) -> int | None:
    """O for a LongRoPE model whose generate recomputes its cache there (the engine follows it), else None."""
    return longrope_threshold(config) if config.model_type in RECOMPUTING_TYPES else None
