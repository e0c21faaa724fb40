"""A decoder's tree forward without transformers' per-call wrapping, for the architectures whose forward it
reproduces op for op.

transformers' model, decoder layer and attention forwards are wrapped (keyword deprecation, output
capture, config defaults, the attention interface's checks): on a 2-core CPU that wrapping cost about
0.9 ms of a 6-7 ms forward of the shipped target (8 layers, 16 tree tokens, bf16), and 0.3 ms of the
draft's 1 ms. `lean_forward(model)` runs the same computation as the model's own forward: the same
submodules (embedding, rotary embedding, norms, projections, MLP), the attention interface the model is
configured with, the model's rotary embedding applied as its `apply_rotary_pos_emb` applies it (in fewer ops,
the same values bit for bit: `apply_rotary`), the same ops on the same operands in the same order, so the logits
are the model's bit for bit (tested against
`model(...)` in float32 and bfloat16, with and without grouped-query attention; the hidden states too).
Only the wrapping is skipped, and only where nothing hangs on it: an architecture listed in
`LEAN_ARCHITECTURES` (Llama, Qwen2, Mistral: layers wired alike), no hooks (but transformers' own inactive
ones that collect hidden states) or replaced `forward` on the modules whose forward it does not call, not
training, a 4D mask tensor or none (then the model's own masks, made by its own functions). Anything else
runs the model's forward. `OPTTREE_LEAN=0` turns it off (to measure it: `python scripts/lean_forward.py`).

One liberty, where bf16 weights run packed (`opttree.packed`): a layer's q, k, v, and its MLP's gate, up,
each take one product over their stacked weights (`shared_inputs`), whose columns were checked bit for bit
against the separate layers' outputs on this machine; elsewhere each projection is called as the model does.
And a second, on CPUs whose bf16 attention kernel is slow: the keys and values kept in float32 after the prefill and
the queries cast to them (`float32_attention`): the same function, rounded otherwise.
"""

from __future__ import annotations

import os
import statistics
import time
import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, slice_logits_to_keep
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2
from transformers.utils import output_capturing

from ..packed import MEMORY_SHARE, active_pack, available_bytes, register_shared_inputs
from .attention import mask_layout
from .cache import cache_argument, last_logits_only, select_rows


@dataclass
class Rider:
    """Prompts prefilled in another forward's products (`_decode`'s riders): their own cache and causal masks, the
    weights read once for that forward's rows and theirs. A batch's joining requests ride its next step
    (`engine.Generation`). `keep`: the last positions whose logits are wanted (at least one); `logits` (B, keep, V)
    once the forward ran."""

    input_ids: torch.Tensor  # (B, P), right-padded to the longest
    position_ids: torch.Tensor  # (B, P)
    cache: object  # a cache of their own (empty)
    keep: int
    logits: torch.Tensor | None = None
    copies: list[int] | None = None  # rows that share prompts: each one's row of the B prefilled (None: B rows)

    def spread(self, lengths: list[int]) -> None:
        """After the forward, where rows share prompts (`copies`): each row gets its prompt's cache row and logits,
        its prefix `lengths[r]` long. The same keys and values as a forward of its own."""
        if self.copies is not None:
            select_rows(self.cache, self.copies, lengths)
            self.logits = self.logits[self.copies]  # (R, keep, V)

    def alone(self, model, hidden: bool = False) -> tuple | None:
        """The same prefill in a forward of its own (a prompt's prefill; a rider where no forward it could ride
        runs); with `hidden`, returns the model's hidden states ((B, P, H) per layer)."""
        forward = lean_forward(model, None) or model  # the model's own forward, without its wrapping where that applies
        out = forward(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=True,
                      **{cache_argument(model): self.cache}, output_hidden_states=hidden,
                      **last_logits_only(model, self.keep))
        self.logits = out.logits[:, -self.keep:]
        return out.hidden_states if hidden else None


def _llama_masks(model, **arguments) -> list:
    """Each layer's mask as LlamaModel.forward makes it when given none (its own causal mask)."""
    return [create_causal_mask(config=model.config, **arguments)] * model.config.num_hidden_layers


def _mistral_masks(model, **arguments) -> list:
    make = create_causal_mask if model.config.sliding_window is None else create_sliding_window_causal_mask
    return [make(config=model.config, **arguments)] * model.config.num_hidden_layers


def _qwen2_masks(model, **arguments) -> list:
    by_type = {"full_attention": create_causal_mask(config=model.config, **arguments)}
    if model.model.has_sliding_layers:
        by_type["sliding_attention"] = create_sliding_window_causal_mask(config=model.config, **arguments)
    return [by_type[kind] for kind in model.config.layer_types[: model.config.num_hidden_layers]]


# Architectures whose forward `_decode` reproduces: the modeling file that holds their functions, what their
# attention module passes its attention function besides Llama's arguments, and their model's own masks.
LEAN_ARCHITECTURES = {
    modeling_llama.LlamaForCausalLM: (modeling_llama, lambda attention: {}, _llama_masks),
    modeling_qwen2.Qwen2ForCausalLM: (
        modeling_qwen2, lambda attention: {"sliding_window": attention.sliding_window}, _qwen2_masks),
    modeling_mistral.MistralForCausalLM: (
        modeling_mistral, lambda attention: {"sliding_window": getattr(attention.config, "sliding_window", None)},
        _mistral_masks),
}

_RUNNERS: "weakref.WeakKeyDictionary[torch.nn.Module, LeanForward]" = weakref.WeakKeyDictionary()


class LeanForward(torch.nn.Module):
    """The model's forward as `_decode` runs it, called like the model (`input_ids`, `position_ids`,
    `attention_mask`, the cache by either keyword); returns an object with `.logits`. A module itself, so
    that what counts ops inside models' forwards (`opttree.counters`) counts these too."""

    def __init__(self, model: torch.nn.Module, architecture: tuple):
        super().__init__()
        object.__setattr__(self, "_model", weakref.ref(model))  # not a submodule: no second set of parameters
        self.architecture = architecture
        inner = model.model  # the modules whose forward `_decode` does not call (the model itself aside: weakly held)
        object.__setattr__(self, "_skipped", (inner, *inner.layers, *(layer.self_attn for layer in inner.layers),
                                              *(layer.mlp for layer in inner.layers)))

    def applies(self) -> bool:
        """Whether nothing hangs on the skipped forwards: no hooks (but transformers' own inactive ones that
        collect hidden states), no replaced `forward`."""
        return not any(module._forward_pre_hooks or "forward" in vars(module)
                       or not all(_capturing(hook) for hook in module._forward_hooks.values())
                       for module in (self._model(), *self._skipped))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache=None, past_key_values=None, use_cache: bool = True, output_hidden_states: bool = False,
                logits_to_keep: int = 0, riders: tuple[Rider, ...] = ()):
        model = self._model()
        logits, hidden = _decode(model, *self.architecture, input_ids, position_ids, attention_mask,
                                 cache if cache is not None else past_key_values, output_hidden_states, logits_to_keep,
                                 riders)
        return SimpleNamespace(logits=logits, hidden_states=hidden)


def lean_forward(model: torch.nn.Module, attention_mask) -> LeanForward | None:
    """What runs `model` on a tree forward: a `LeanForward` where it reproduces the model's own forward
    (module docstring), else None (the model's forward)."""
    architecture = LEAN_ARCHITECTURES.get(type(model))
    if architecture is None or os.environ.get("OPTTREE_LEAN", "1") == "0" or model.training \
            or not (attention_mask is None or isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4) \
            or model.config._attn_implementation not in ("sdpa", "eager"):
        return None
    runner = _RUNNERS.get(model)
    if runner is None:
        runner = _RUNNERS[model] = LeanForward(model, architecture)
    return runner if runner.applies() else None


FLOAT32_ATTENTION_SHARE = 0.8  # a cache is kept in float32 where that attention took at most this share of bf16's


def float32_attention(model: torch.nn.Module, positions: int = 0, rows: int = 8) -> bool:
    """Whether a generation of `rows` rows keeps `model`'s keys and values in float32 (`cache.stack_rows`, after the
    prefill), so that its lean forwards attend in float32 (the queries cast up, the output cast back): on CPUs whose
    bf16 sdpa kernel is slow. On a 2-core AMD EPYC with avx512_bf16 and no AMX, 8 rows of one query over 250 keys (8
    heads of 64) take 616-669 us in bf16 and 91 in float32, and a batch of 8 decoding plainly ran 1.20x faster so
    (docs/BENCHMARKS.md, "Where a batched step goes on this CPU"); one row of one query over 300 keys takes 101 us in
    bf16 and 20 in float32, over 1,000 keys 357 and 48, and 4 to 33 queries under a tree mask 0.6-0.9x bf16's time
    ("Attention in float32 for one sequence"), at twice the cache's memory.
    Measured once per attention shape on first use (`_float32_pays`); only for a CPU model in bf16 or fp16
    configured with sdpa whose every forward after the prefill is the lean one (full or uniformly windowed attention:
    one 4D mask), and only while such a cache of `positions` (rows x positions each) fits in MEMORY_SHARE of the
    memory available. `OPTTREE_FLOAT32_ATTENTION=0` / `=1` turns it off / on without measuring."""
    params = next(model.parameters(), None)
    if params is None or params.device.type != "cpu" or model.config._attn_implementation != "sdpa" \
            or lean_forward(model, None) is None or mask_layout(model.config.get_text_config()).per_type \
            or positions * _float32_bytes(model) > MEMORY_SHARE * available_bytes():
        return False
    return float32_attention_pays(model.model.layers[0].self_attn, params.dtype, rows)


def float32_attention_pays(attention: torch.nn.Module, dtype: torch.dtype, rows: int = 1) -> bool:
    """Whether `rows` rows of one query attend faster in float32 than in `dtype` with `attention`'s heads, on this
    CPU (`_float32_pays`; never for a float32 model), for forwards of opttree's own that keep their keys and values
    in float32 where it pays (a draft's, a feature head's: `opttree.step.draft_forward`).
    `OPTTREE_FLOAT32_ATTENTION=0` / `=1` as for `float32_attention`."""
    forced = os.environ.get("OPTTREE_FLOAT32_ATTENTION", "auto")
    if forced == "0" or dtype not in (torch.bfloat16, torch.float16):
        return False
    return forced == "1" or _float32_pays(attention, dtype, rows)


_PAYS: dict[tuple, bool] = {}


def _heads(attention: torch.nn.Module) -> tuple[int, int, int]:
    """An attention module's (query heads, key-value heads, head dim)."""
    config = attention.config
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, attention.head_dim


def _float32_bytes(model: torch.nn.Module) -> int:
    """Bytes a position of one row takes in a float32 cache of `model`: keys and values of every layer."""
    _, kv_heads, dim = _heads(model.model.layers[0].self_attn)
    return 2 * model.config.num_hidden_layers * kv_heads * dim * 4


def _float32_pays(attention: torch.nn.Module, dtype: torch.dtype, rows: int = 8) -> bool:
    """Whether sdpa over `rows` rows (at most 8) of one query and 256 keys, `attention`'s heads, takes at most
    FLOAT32_ATTENTION_SHARE of its time in `dtype` when run in float32 (the median of 7 alternated calls; a few ms,
    once per shape)."""
    heads, kv_heads, dim = _heads(attention)
    rows = max(1, min(rows, 8))
    key = (heads, kv_heads, dim, dtype, rows, torch.get_num_threads())
    if key not in _PAYS:
        generator = torch.Generator().manual_seed(0)
        inputs = [torch.randn(rows, n, length, dim, generator=generator)
                  for n, length in ((heads, 1), (kv_heads, 256), (kv_heads, 256))]
        kinds = {kind: [t.to(kind) for t in inputs] for kind in (dtype, torch.float32)}  # (query, keys, values)
        times: dict[torch.dtype, list[float]] = {kind: [] for kind in kinds}
        with torch.inference_mode():
            for repeat in range(8):
                for kind, (query, keys, values) in kinds.items():
                    start = time.perf_counter()
                    torch.nn.functional.scaled_dot_product_attention(query, keys, values, enable_gqa=kv_heads != heads)
                    if repeat:
                        times[kind].append(time.perf_counter() - start)
        fast, slow = statistics.median(times[torch.float32]), statistics.median(times[dtype])
        _PAYS[key] = fast <= FLOAT32_ATTENTION_SHARE * slow
    return _PAYS[key]


def shared_inputs(model: torch.nn.Module) -> list[tuple[torch.nn.Module, ...]]:
    """The linear layers that `_decode` applies to one input, which may run as one product (`packed`): each
    layer's q, k, v and its MLP's gate, up. None for an architecture it does not drive (an empty list)."""
    if type(model) not in LEAN_ARCHITECTURES:
        return []
    layers = model.model.layers[: model.config.num_hidden_layers]
    return [group for layer in layers for group in ((layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                     layer.self_attn.v_proj), (layer.mlp.gate_proj, layer.mlp.up_proj))]


register_shared_inputs(shared_inputs)


def _products(pack, layers: tuple[torch.nn.Module, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each layer applied to x: one product where the model's packed linears run them together, else each called."""
    return pack.products(layers, x) if pack is not None else tuple(layer(x) for layer in layers)


def _capturing(hook) -> bool:
    """Whether a forward hook is one transformers installs on decoder layers to collect hidden states
    (`transformers.utils.output_capturing`, on the first forward that asks for them): it records only
    while that model's own forward collects, so a forward that does not call it loses nothing."""
    return getattr(hook, "__module__", None) == output_capturing.__name__


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """(..., Dh) sin -> its first half negated (exact): `apply_rotary`'s second operand."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding as the architectures' `apply_rotary_pos_emb` computes it, x * cos + rotate_half(x) *
    sin, bit for bit in 4 ops instead of 8: rotate_half(x) = cat(-x2, x1) is x rolled by half a head with its first
    half negated, and -x2 * sin1 == x2 * -sin1 exactly, so the sign moves to sin (`signed_sin`, once a forward)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _decode(model, modeling, attention_options, own_masks, input_ids: torch.Tensor, position_ids: torch.Tensor,
            mask: torch.Tensor | None, cache, hidden_states: bool = False, logits_to_keep: int = 0,
            riders: tuple[Rider, ...] = ()) -> tuple[torch.Tensor, tuple | None]:
    """LlamaForCausalLM.forward's computation (transformers 5.x; Qwen2's and Mistral's are the same with
    `attention_options`): (B, Q) ids -> (B, Q, V) logits, and with `hidden_states` the model's: the
    embeddings, each layer's output but the last, and the last one normed ((B, Q, H) each). `mask` None:
    the model's own masks (`own_masks`, made as its forward makes them, before the cache grows).
    `logits_to_keep`: the model's argument (the last positions' logits only).
    `riders`: prompts prefilled in the same forward (`Rider`): every position's norms, products and MLP as one
    (N, H) block of the forward's rows and theirs (the weights read once), attention apart, each over its own
    cache under its own mask; each rider's logits set on it. Without riders every op is the model's, as above."""
    inner, config = model.model, model.config
    segments = [_Segment(inner, own_masks, model, input_ids, position_ids, mask, cache)]
    segments += [_Segment(inner, own_masks, model, r.input_ids, r.position_ids, None, r.cache) for r in riders]
    hidden = segments[0].hidden if not riders else torch.cat([seg.hidden.flatten(0, 1) for seg in segments])
    sizes = [seg.rows for seg in segments]  # each segment's rows of `hidden` (B * Q each), with riders
    kept = [hidden] if hidden_states else None
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, modeling.eager_attention_forward)
    pack = active_pack(model)  # the model's packed linears, while a generation runs them
    for i, layer in enumerate(inner.layers[: config.num_hidden_layers]):
        attention, mlp = layer.self_attn, layer.mlp
        residual = hidden
        hidden = layer.input_layernorm(hidden)
        products = _products(pack, (attention.q_proj, attention.k_proj, attention.v_proj), hidden)
        outs = []
        for seg, (query, key, value) in zip(segments, zip(*(p.split(sizes) for p in products)) if riders else
                                            [products]):
            shape = (*seg.hidden.shape[:-1], -1, attention.head_dim)
            query, key, value = (out.view(shape).transpose(1, 2) for out in (query, key, value))  # (B, heads, Q, Dh)
            query, key = apply_rotary(query, seg.cos, seg.sin), apply_rotary(key, seg.cos, seg.sin)
            if seg.cache is not None:
                key, value = seg.cache.update(key, value, attention.layer_idx, kwargs=seg.extra)
            # (B, Q, heads, Dh); a cache kept in float32 (`float32_attention`): the queries cast to it, the output back
            out, _ = attend(attention, query.to(key.dtype), key, value, seg.masks[i], dropout=0.0,
                            scaling=attention.scaling, **attention_options(attention), **seg.extra)
            outs.append(out.reshape(*seg.hidden.shape[:-1], -1) if not riders else
                        out.reshape(seg.rows, -1).to(hidden.dtype))
        out = outs[0] if not riders else torch.cat(outs)
        hidden = residual + attention.o_proj(out.to(hidden.dtype).contiguous())
        residual = hidden
        gate, up = _products(pack, (mlp.gate_proj, mlp.up_proj), layer.post_attention_layernorm(hidden))
        hidden = residual + mlp.down_proj(mlp.act_fn(gate) * up)  # the MLP's forward
        if kept is not None:
            kept.append(hidden)
    hidden = inner.norm(hidden)
    if kept is not None:
        kept[-1] = hidden
    if not riders:
        return model.lm_head(slice_logits_to_keep(hidden, logits_to_keep)), tuple(kept) if kept is not None else None
    # one vocabulary product for the forward's rows and the riders' kept ones
    parts = [seg_hidden.view(seg.hidden.shape) for seg_hidden, seg in zip(hidden.split(sizes), segments)]
    wanted = [slice_logits_to_keep(parts[0], logits_to_keep)] + [part[:, part.shape[1] - r.keep:] for part, r in
                                                                  zip(parts[1:], riders)]  # (B, K, H) each
    logits = model.lm_head(torch.cat([w.flatten(0, 1) for w in wanted]))
    logits = logits.split([w.shape[0] * w.shape[1] for w in wanted])
    for rider, rows, w in zip(riders, logits[1:], wanted[1:]):
        rider.logits = rows.view(*w.shape[:2], -1)
    first = segments[0]
    states = tuple(h[: first.rows].view(first.hidden.shape) for h in kept) if kept is not None else None
    return logits[0].view(*wanted[0].shape[:2], -1), states


class _Segment:
    """One set of rows of `_decode`: its embeddings (B, Q, H), rotary operands, per-layer masks and cache."""

    def __init__(self, inner, own_masks, model, input_ids, position_ids, mask, cache):
        self.hidden = inner.embed_tokens(input_ids)  # (B, Q, H)
        self.rows = input_ids.numel()
        self.cache = cache
        self.masks = own_masks(model, inputs_embeds=self.hidden, attention_mask=None, cache=cache,
                               position_ids=position_ids) if mask is None else [mask] * model.config.num_hidden_layers
        cos, sin = inner.rotary_emb(self.hidden, position_ids=position_ids)  # (B, Q, Dh) each
        self.cos, self.sin = cos.unsqueeze(1), signed_sin(sin).unsqueeze(1)  # (B, 1, Q, Dh): `apply_rotary`'s operands
        self.extra = {"position_ids": position_ids, "use_cache": True}  # what the decoder layer hands its attention
