"""Certification: refuse, before any output, a model whose tree forward would not be exact.

Two layers, both run by `certify(model, role, max_len, tree_rows)`:
1. Named reasons (`KNOWN_REASONS`): classes of models known to break tree attention, each with its
   real cause (recurrent state without transformers' state layers, bidirectional attention, rope
   scaling that switches with the sequence length, a key-index causal buffer, ...). A model whose
   attention reads key indices (ALiBi, GPT-Neo's local layers, positions from the cache length) or
   that has state layers runs as chains instead (`opttree.step.chains`), target or draft, with its own probe.
2. A numerical probe, cached per configuration: prefill, one tree forward (4D mask, explicit
   position_ids, extending the cache), compaction to one branch and one more step, each compared with
   a plain causal forward of that branch. Anything the named reasons miss is caught here, and a model
   that crashes inside its own code is refused with the architecture's name instead of a stack trace.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Callable

import torch
from transformers import PreTrainedModel

from .step.attention import mask_layout
from .step.cache import cache_argument, compact, new_cache, static_cache
from .step.chains import probe_chains, verified_as_chains
from .step.rope import rope_kinds, rope_switch
from .step.tree import DraftTree
from .step.verify import verify_tree

PROBE_MAX_LEN = 64  # the probe's sequence reaches min(max_len, this) positions (its bucket)
# The probe's tree: root, then two branches of two nodes (r -> a -> b, r -> c -> d).
PROBE_PARENTS = (-1, 0, -1, 2)
PROBE_DEPTHS = (1, 2, 1, 2)
PROBE_BRANCHES = ((0, 1, 2), (0, 3, 4))  # rows of [root] + nodes on each root -> leaf path
PROBE_PADDED_WIDTH = 6  # the static path pads the 4 nodes to 6

_certified: dict[tuple, str | None] = {}  # probe key -> reason of failure (None = exact)
INSTEAD = "what to do instead: the model's own `generate`, which runs it without speculation"


def certify(model: PreTrainedModel, role: str, max_len: int, tree_rows: int, static: bool = False) -> None:
    """Raise NotImplementedError naming the architecture and the reason if the engine cannot drive
    `model` exactly up to `max_len` tokens, with up to `tree_rows` extra cache rows during a step
    (`static`: over the static path's preallocated cache of max_len + tree_rows positions, with padded
    trees)."""
    config = model.config.get_text_config()
    name = f"{role} model ({type(model).__name__}, model_type={config.model_type!r})"
    for check in KNOWN_REASONS:
        reason = check(model, config, max_len, tree_rows)
        if reason:
            raise NotImplementedError(f"{name}: {reason}; opttree cannot verify a draft tree on it exactly "
                                      f"({INSTEAD})")
    if verified_as_chains(model):  # run as a batch of chains (`opttree.step.chains`), as a target or a draft: its own check
        reason = _cached(model, ("chains",), lambda: probe_chains(model))
        if reason:
            raise NotImplementedError(f"{name} failed opttree's exactness check for chain verification: {reason} "
                                      f"({INSTEAD})")
        return
    length = min(max_len, PROBE_MAX_LEN)
    switch = rope_switch(config)
    if switch is not None and length - 4 <= switch < length:  # the probe's forwards on one side of LongRoPE's
        length = max(switch, 6)                              # switch, where one causal forward is a reference
    reason = probe(model, length, max_len + tree_rows if static else None) or window_probe(model, max_len)
    if reason:
        raise NotImplementedError(f"{name} failed opttree's exactness check: {reason} ({INSTEAD})")


WINDOW_FIELDS = ("sliding_window", "attention_chunk_size")  # what `opttree.step.attention.mask_layout` reads
PROBE_WINDOW = 3


def window_probe(model: PreTrainedModel, max_len: int) -> str | None:
    """A model whose generation reaches past a window of its layers, probed with its windows set to
    PROBE_WINDOW positions (the config is read at every forward, by the model's masks and by opttree's):
    the probe's tree then crosses them, so the model's own windowed masks are checked against
    `opttree.step.attention`'s on positions (a config whose `sliding_window` the model's sdpa path does not
    apply is refused, not trusted). Within its windows, every layer is plain causal attention."""
    config = model.config.get_text_config()
    windows = [w.size for w in mask_layout(config).windows.values() if w is not None]
    if not windows or max_len <= min(windows):
        return None
    saved = {field: getattr(config, field) for field in WINDOW_FIELDS if isinstance(getattr(config, field, None), int)}
    try:
        for field in saved:
            setattr(config, field, PROBE_WINDOW)
        reason = probe(model, 12)
    finally:
        for field, value in saved.items():
            setattr(config, field, value)
    return reason and f"with its windows set to {PROBE_WINDOW} positions, {reason}"


# ---- named reasons: (model, text config, max_len, tree_rows) -> reason or None -------------------------

# models whose cache is no key per position and no state a chain continues (transformers' state layers, and
# the states of `opttree.step.own_state`, run as chains, checked by `opttree.step.chains.probe_chains`)
BUCKETED_TYPES = ("reformer",)
LENGTH_SWITCHED_ROPE = ("longrope", "dynamic")
OWN_CACHE_TYPES = ("xlm",)  # a forward argument named `cache` that is not a positioned KV cache


def bucketed(model, config, max_len: int, tree_rows: int) -> str | None:
    if config.model_type in BUCKETED_TYPES:
        return ("its LSH and chunked local attention cache hash buckets and chunks of past hidden states, not a key "
                "per position that a tree mask or a chain could address")
    return None


def bidirectional(model, config, max_len: int, tree_rows: int) -> str | None:
    if getattr(config, "is_decoder", None) is False and hasattr(config, "add_cross_attention"):
        return "it is a bidirectional encoder (is_decoder=False); load it with is_decoder=True for causal generation"
    both_ways = getattr(config, "use_bidirectional_attention", False)
    if both_ways and both_ways != "vision":  # "vision": both ways among image tokens only; text stays causal
        return f"it uses bidirectional attention (use_bidirectional_attention={both_ways!r})"
    return None


def key_index_buffer(model, config, max_len: int, tree_rows: int) -> str | None:
    """GPT-Neo slices a causal buffer of max_position_embeddings rows by the cache length."""
    limit = getattr(config, "max_position_embeddings", None)
    if config.model_type == "gpt_neo" and max_len + tree_rows > limit:
        return (f"its causal mask is a buffer of {limit} key rows and a step holds up to {max_len + tree_rows} "
                f"(prompt + max_new_tokens + budget + 1); keep that <= {limit}")
    return None


def length_switched_rope(model, config, max_len: int, tree_rows: int) -> str | None:
    """Dynamic NTK picks new rope factors for every longer forward (from its largest position): plain
    decoding gives each token past the threshold factors of its own, which one tree forward cannot. LongRoPE
    switches once; the engine follows the models whose generate recomputes the cache there (`opttree.step.rope`)."""
    for rope_type, threshold in rope_kinds(config):
        if rope_type not in LENGTH_SWITCHED_ROPE or (rope_type == "longrope" and rope_switch(config) is not None):
            continue
        if threshold is not None and max_len > threshold:
            return (f"its rope_type={rope_type!r} switches factors at original_max_position_embeddings={threshold} "
                    f"and this generation reaches {max_len} tokens; keep prompt + max_new_tokens <= {threshold}")
    return None


def no_kv_cache(model, config, max_len: int, tree_rows: int) -> str | None:
    """openai-gpt has no cache, XLM its own `cache` (fed the whole sequence, it drops the rows already
    cached), CPM-Ant a cache without explicit positions. The cache is `past_key_values` before
    transformers 5.24, `cache` from 5.24 (`cache_argument`)."""
    params = _forward_params(type(model))
    takes_cache = cache_argument(model) in params and config.model_type not in OWN_CACHE_TYPES
    # a model run as chains needs no position_ids: a chain's positions are those of plain decoding (`probe_chains`)
    positioned = "position_ids" in params or verified_as_chains(model)
    missing = ([] if takes_cache else ["past_key_values"]) + ([] if positioned else ["position_ids"])
    if missing:
        return f"its forward takes no {' / '.join(missing)}, which a tree forward over a KV cache needs"
    return None


@lru_cache(maxsize=None)
def _forward_params(model_class: type) -> frozenset:
    return frozenset(inspect.signature(model_class.forward).parameters)


def activation_quantization(model, config, max_len: int, tree_rows: int) -> str | None:
    """torchao's dynamic activation quantization (weights whose `act_quant_kwargs` is set) and bitsandbytes'
    8-bit (LLM.int8: activations rounded to int8 by row, and the columns with an outlier in *any* token of the
    forward computed apart in 16 bits) quantize activations at run time: the float rounding that differs
    between a tree forward and a one-token decode becomes a whole step (logits ~1e-2 to 1e-1 apart), and with
    LLM.int8 a token's result depends on the other tokens of its forward."""
    if any(getattr(p, "act_quant_kwargs", None) is not None for p in model.parameters()):
        return ("its activations are quantized at run time (torchao dynamic activation quantization), which turns "
                "float rounding differences between forwards into whole int8 steps; quantize the weights only "
                "(e.g. torchao Int8WeightOnlyConfig, `--quantize int8`)")
    if _quantization(config).get("load_in_8bit"):
        return ("its activations are quantized at run time (bitsandbytes 8-bit, LLM.int8: int8 rows and outlier "
                "columns chosen from every token of a forward); load it in 4 bits (`load_in_4bit=True`: weights "
                "only) or quantize the weights with torchao (`--quantize int8`)")
    return None


def _quantization(config) -> dict:
    """The model's `quantization_config` as a dict ({} for a model not quantized by transformers' loader)."""
    quantization = getattr(config, "quantization_config", None)  # set only on models loaded quantized
    if quantization is None:
        return {}
    return quantization if isinstance(quantization, dict) else quantization.to_dict()


KNOWN_REASONS: tuple[Callable[..., str | None], ...] = (
    bucketed, bidirectional, key_index_buffer, length_switched_rope, activation_quantization,
    no_kv_cache,  # last: the classes above are its most common cases, named by their real cause
)


# ---- the numerical probe ------------------------------------------------------------------------


def probe(model: PreTrainedModel, length: int, capacity: int | None = None) -> str | None:
    """Cached `run_probe`: the reason the tree forward is not exact for this configuration, or None."""
    return _cached(model, (length, capacity), lambda: run_probe(model, length, capacity))


def _cached(model: PreTrainedModel, extra: tuple, run: Callable[[], str | None]) -> str | None:
    """`run()`'s reason, once per model configuration (every attribute of the config: the repr of its
    __dict__ is 40x cheaper than to_json_string, which is per-call overhead of every generate); a model that
    crashes inside its own code is refused by name."""
    key = (type(model), repr(vars(model.config)), model.config._attn_implementation, model.dtype,
           str(model.device), *extra)
    if key not in _certified:
        with torch.inference_mode():
            try:
                _certified[key] = run()
            except Exception as error:  # a model that cannot run a tree forward: refuse it by name
                _certified[key] = f"a forward raised {type(error).__name__}: {str(error)[:300]}"
    return _certified[key]


def run_probe(model: PreTrainedModel, length: int, capacity: int | None = None) -> str | None:
    """Prefill, tree forward, compaction and one more step, each against causal forwards of the branch.

    length: the probe sequence's last position + 1 (>= 6). capacity: the static path's (a preallocated
    cache of that many positions, the tree padded: its forwards, eager); None: the dynamic cache."""
    device = model.device
    vocab = model.get_input_embeddings().weight.shape[0]
    prefix_len = max(length - 4, 2)  # root at prefix_len, the second branch's next token at prefix_len + 3
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, max(vocab, 4), (prefix_len + 6,), generator=g).clamp(max=vocab - 1).to(device)
    prefix, tree_tokens, after = tokens[:prefix_len], tokens[prefix_len:prefix_len + 5], tokens[-1:]
    parents = torch.tensor(PROBE_PARENTS, device=device)  # (4,)
    depths = torch.tensor(PROBE_DEPTHS, device=device)

    static = capacity is not None
    cache = static_cache(model, max(capacity, prefix_len + PROBE_PADDED_WIDTH + 1)) if static else new_cache(model)
    model(input_ids=prefix[None], position_ids=torch.arange(prefix_len, device=device)[None],
          **{cache_argument(model): cache}, use_cache=True)
    tree = DraftTree(tree_tokens[1:], parents, depths, torch.zeros(4, device=device), parents)
    tree_logits = verify_tree(model, cache, tree_tokens[0], tree, prefix_len, width=PROBE_PADDED_WIDTH,
                              compiled=False)  # (5, V)
    rounding = _compute_dtype(model, tree_logits.dtype)
    for branch in PROBE_BRANCHES:
        rows = torch.tensor(branch, device=device)
        reference = _causal_logits(model, torch.cat([prefix, tree_tokens[rows]]))[-3:]  # (3, V)
        if not _close(tree_logits[rows], reference, rounding):
            return (f"the tree forward's logits on branch {branch} differ from a causal forward "
                    f"(max |diff| {_diff(tree_logits[rows], reference):.3g})")

    keep = torch.tensor(PROBE_BRANCHES[1], device=device)
    compact(cache, prefix_len, keep)
    step = verify_tree(model, cache, after[0], DraftTree.empty(device), prefix_len + 3, compiled=False)  # (1, V)
    reference = _causal_logits(model, torch.cat([prefix, tree_tokens[keep], after]))[-1:]
    if not _close(step, reference, rounding):
        return f"after compacting the cache to one branch, the next step differs (max |diff| {_diff(step, reference):.3g})"
    return None


def _causal_logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """ids: (T,) -> logits (T, V) of one plain causal forward without cache."""
    return model(input_ids=ids[None], position_ids=torch.arange(ids.shape[0], device=ids.device)[None],
                 use_cache=False).logits[0]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _close(a: torch.Tensor, b: torch.Tensor, rounding: torch.dtype) -> bool:
    """Equal up to the rounding of the dtype the model computes in (different kernels, same maths)."""
    scale = 1.0 + float(b.float().abs().max())
    tolerance = max(1e-4, 16 * torch.finfo(rounding).eps) * scale
    return _diff(a, b) <= tolerance


def _compute_dtype(model: PreTrainedModel, logits: torch.dtype) -> torch.dtype:
    """The dtype whose rounding a forward carries: the logits', or bitsandbytes 4-bit's declared compute dtype
    where that is coarser (its layers compute in it whatever the model's dtype)."""
    declared = _quantization(model.config).get("bnb_4bit_compute_dtype")
    compute = getattr(torch, declared) if isinstance(declared, str) else logits
    return compute if torch.finfo(compute).eps > torch.finfo(logits).eps else logits
