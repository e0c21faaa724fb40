"""A small draft model's forward with less around its arithmetic, for drafting only.

On a CPU a small draft's forward is mostly overhead: the shipped draft (one Llama layer of width 256) takes
1.1-1.3 ms a forward through transformers' modules on a 2-core Xeon, for ~0.1 ms of arithmetic.
`DraftForward` computes the same function with q, k and v in one matrix product and gate and up in one
(their weights stacked once: 4 products a layer instead of 7), the rotary cos / sin looked up in a table
the model's own rotary embedding filled (not recomputed each forward), RMSNorm as a few tensor ops, no
module of the model called but the embedding and the activation, the residual stream in float32 and the
small products too (from float32 copies of their weights), products of a few rows from int8 copies (a
forward right after the target's reads its weights from memory: `_Product`), the model's own KV cache
(`cache.update`; kept in float32 where bf16 attention is slow: `lean.float32_attention`), sdpa: 0.6-0.75 ms a
forward there. `python scripts/lean_forward.py --switch draft` measures
what it gains in a generation.

It is not the model's forward bit for bit (the roundings differ: log-probabilities move by ~0.05 in
bf16, and more where the int8 copies run), and a draft does not need to be: it only proposes. Trees of
top-ranked tokens are verified by the target alone, and sampled trees carry the distribution their children
were drawn from, whatever computed it, so the output is exact either way (docs/METHODS.md). So it runs draft
models only (`ModelDrafter`) and, with the same layers, feature heads (`HeadForward`, for `HeadDrafter`), never a
target.

It applies where it computes what the model computes: a Llama, Qwen2 or Mistral model that `lean_forward`
drives (no hooks, not training, sdpa or eager attention), on a CPU, full attention in every layer, a rotary
embedding that depends on the position alone, plain weights (not quantized), whose stacked copies stay
under MAX_COPY_BYTES. Elsewhere `draft_forward` returns None and the drafter runs `lean_forward` or the model.
`OPTTREE_DRAFT_FORWARD=0` turns it off.
"""

from __future__ import annotations

import os
import weakref
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ..packed import PackedMatmul, packing_applies
from .attention import mask_layout
from .lean import apply_rotary, float32_attention, float32_attention_pays, lean_forward, signed_sin

FLOAT32_COPY_BYTES = 2 * 2**20  # a stacked weight this small in float32 runs from a float32 copy (`_Product`)
INT8_ROWS = 4  # a product of at most this many rows runs from an int8 copy of the weight (`_Product`)
MAX_COPY_BYTES = 256 * 2**20  # the stacked q/k/v and gate/up weights are copies: drafts whose layers hold at most this
STATIC_ROPE = ("default", "linear", "llama3")  # rotary embeddings whose cos / sin depend on the position alone

_RUNNERS: "weakref.WeakKeyDictionary[torch.nn.Module, DraftForward]" = weakref.WeakKeyDictionary()


def draft_forward(model: torch.nn.Module) -> "DraftForward | None":
    """What runs `model` as a draft (module docstring): a `DraftForward`, made once and again when a weight
    changed, or None where it does not apply."""
    if os.environ.get("OPTTREE_DRAFT_FORWARD", "1") == "0" or lean_forward(model, None) is None \
            or not _applies(model):
        return None
    runner = _RUNNERS.get(model)
    if runner is None or runner.stale() or runner.int8_copies != _int8_copies() \
            or runner.attention_dtype != _attention_dtype(model):
        runner = _RUNNERS[model] = DraftForward(model)
    return runner


def _attention_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the draft's cached keys and values and of its queries: float32 where bf16 attention over one
    row is slow on this CPU (`lean.float32_attention`), else the model's."""
    return torch.float32 if float32_attention(model, rows=1) else model.dtype


def _int8_copies() -> bool:
    """Whether products of a few rows run from int8 copies of the weights (`_Product`; `OPTTREE_DRAFT_INT8=0`: not)."""
    return os.environ.get("OPTTREE_DRAFT_INT8", "1") != "0"


def _applies(model: torch.nn.Module) -> bool:
    return _layers_apply(model.config, model.model.layers, model.device)


def _layers_apply(config, layers: torch.nn.Module, device: torch.device) -> bool:
    """Whether `decoder_layers` computes what these Llama-like layers of a model configured so compute."""
    rope = config.rope_parameters or {}
    linears = [m for m in layers.modules() if isinstance(m, torch.nn.Linear)]
    return (device.type == "cpu" and not mask_layout(config).windowed
            and not any(isinstance(value, dict) for value in rope.values())  # one per layer type: not here
            and rope.get("rope_type", "default") in STATIC_ROPE
            and all(type(m) is torch.nn.Linear and type(m.weight) is torch.nn.Parameter for m in linears)
            and sum(m.weight.numel() * m.weight.element_size() for m in linears) <= MAX_COPY_BYTES)


class _Layer:
    """One decoder layer's weights, stacked where two products take the same input."""

    def __init__(self, layer: torch.nn.Module, packed: bool):
        attention, mlp = layer.self_attn, layer.mlp
        self.heads = attention.q_proj.out_features // attention.head_dim
        self.kv_heads = attention.k_proj.out_features // attention.head_dim
        self.head_dim, self.scaling, self.index = attention.head_dim, attention.scaling, attention.layer_idx
        self.qkv = _stacked([attention.q_proj, attention.k_proj, attention.v_proj], packed)
        self.out = _stacked([attention.o_proj], packed)
        self.gate_up = _stacked([mlp.gate_proj, mlp.up_proj], packed)
        self.down = _stacked([mlp.down_proj], packed)
        self.act = mlp.act_fn
        self.norms = [(norm.weight.detach().float(), norm.variance_epsilon)
                      for norm in (layer.input_layernorm, layer.post_attention_layernorm)]


def _stacked(linears: list[torch.nn.Linear], packed: bool) -> "_Product":
    """The linears' weights one above the other (a copy; one linear: its own weight), and their biases."""
    weight = torch.cat([m.weight.detach() for m in linears]) if len(linears) > 1 else linears[0].weight.detach()
    biases = [m.bias for m in linears]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.detach() if b is not None else m.weight.new_zeros(m.out_features) for b, m in zip(biases, linears)])
    return _Product(weight, bias, packed)


class _Product:
    """x (..., in) in any float dtype -> x W^T + b (..., out) in float32.

    A product of at most INT8_ROWS rows runs from an int8 copy of W (per output row, symmetric:
    `torch._weight_int8pack_mm`, the input in bf16): a draft's forward reads its weights from memory, since the
    target's forward between two steps evicts them from every cache, and int8 reads a quarter of float32's bytes,
    half of bf16's. On a 2-core AMD EPYC with avx512_bf16 the shipped draft's forward right after a target's took
    734 us, then 491 and 433 for the next two, and 444, 336, 312 so (docs/BENCHMARKS.md, "The draft's weights in
    int8"); its distribution moved by a total variation of 0.005. The int8 kernel's time grows with the rows (the
    8192 x 256 head: 41 us for one row, 162 for 8, against 51 and 81 packed in bf16, in cache), so more rows take
    the other copies: a weight of at most FLOAT32_COPY_BYTES in float32 runs from a transposed float32 copy (a
    product of a few rows by it is overhead-bound, and on a 2-core Xeon with AMX the float32 kernel has less of it
    than the bf16 one: 8 rows by 768 x 256 take 10 us against 29 packed in bf16), larger weights in the model's
    dtype (`PackedMatmul`). `OPTTREE_DRAFT_INT8=0` leaves the int8 copies out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool):
        self.small = weight.numel() * 4 <= FLOAT32_COPY_BYTES
        self.bias = None if bias is None else bias.float()
        self.int8 = _int8_copy(weight) if _int8_copies() else None
        if self.small:
            self.transposed = weight.float().t().contiguous()  # (in, out)
        else:
            self.dtype, self.matmul = weight.dtype, PackedMatmul(weight, bias, packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (R, in)
        if self.int8 is not None and flat.shape[0] <= INT8_ROWS:
            out = torch._weight_int8pack_mm(flat.to(torch.bfloat16).contiguous(), *self.int8).float()
            out = out if self.bias is None else out.add_(self.bias)
        elif self.small:
            flat = flat.float()
            out = torch.mm(flat, self.transposed) if self.bias is None else \
                torch.addmm(self.bias, flat, self.transposed)
        else:
            return self.matmul(x.to(self.dtype)).float()
        return out.view(*x.shape[:-1], -1)


def _int8_copy(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(out, in) weight -> (its int8 copy (out, in), the bf16 scale of each output row (out,)), what
    `torch._weight_int8pack_mm` takes; None where this torch lacks that kernel or it would not compute the
    product: its CPU kernel needs `in` a multiple of 16 (torch 2.13: other sizes return garbage or crash), and
    the copy is checked once against the float product of a random input at every row count it will take."""
    if weight.shape[1] % 16 or not hasattr(torch, "_weight_int8pack_mm"):
        return None
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127  # (out,)
    quantized = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    copy = quantized, scale.to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for rows in range(1, INT8_ROWS + 1):
        probe = torch.randn(rows, weight.shape[1], generator=generator).to(torch.bfloat16)  # (R, in)
        want = probe.float() @ (quantized.float() * copy[1].float()[:, None]).t()  # (R, out)
        try:
            got = torch._weight_int8pack_mm(probe, *copy).float()
        except (RuntimeError, NotImplementedError):  # no kernel for this CPU or dtype
            return None
        if (got - want).abs().max() > 0.01 * want.abs().max() + 1e-6:
            return None
    return copy


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(..., H) float32 -> the same, RMS-normalised and scaled by weight (float32). A sum, not a mean: a third
    of the time on a CPU."""
    return x * x.pow(2).sum(-1, keepdim=True).mul_(1 / x.shape[-1]).add_(eps).rsqrt_() * weight


class RopeTable:
    """A rotary embedding's cos and sin by position, from the model's own rotary embedding module (its table grown
    to cover the positions asked for, by doubling): looked up, not recomputed each forward."""

    def __init__(self, rotary_emb: torch.nn.Module, head_dim: int):
        self.rotary_emb = rotary_emb
        self.table = torch.empty(0, 2 * head_dim)  # (P, 2 Dh) float32: cos | sin with its first half negated

    def reserve(self, needed: int) -> None:
        """The table covers positions 0 .. needed - 1."""
        if needed > self.table.shape[0]:
            size = max(needed, 2 * self.table.shape[0], 256)
            probe = torch.zeros(1, size, 1, dtype=torch.float32)
            cos, sin = self.rotary_emb(probe, torch.arange(size)[None])  # (1, P, Dh)
            self.table = torch.cat([cos[0], signed_sin(sin[0])], dim=-1).float()

    def __call__(self, positions: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Q) positions, all below `needed` (or a larger `reserve`) -> cos, sin with its first half negated
        (`lean.apply_rotary`'s operands) (B, 1, Q, Dh) float32."""
        self.reserve(needed)
        rope = self.table.index_select(0, positions.reshape(-1)).view(*positions.shape, 1, -1).transpose(1, 2)
        return rope.chunk(2, dim=-1)  # (B, 1, Q, Dh) each


def decoder_layers(hidden: torch.Tensor, layers: list[_Layer], cos: torch.Tensor, sin: torch.Tensor,
                   mask: torch.Tensor | None, cache, attention_dtype: torch.dtype) -> torch.Tensor:
    """(B, Q, H) float32 residual stream through Llama decoder layers (`_Layer`), their keys and values appended to
    `cache` (None: none kept) and attended in `attention_dtype`; mask: bool, broadcast to (B, heads, Q, keys), or
    None (one query, or causal over nothing cached). Returns (B, Q, H) float32, before the final norm."""
    batch, rows = hidden.shape[:2]
    for layer in layers:
        (first, eps1), (second, eps2) = layer.norms
        heads, kv = layer.heads, layer.kv_heads
        qkv = layer.qkv(_rms_norm(hidden, first, eps1))  # (B, Q, (heads + 2 kv) Dh)
        qkv = qkv.view(batch, rows, heads + 2 * kv, layer.head_dim).transpose(1, 2)  # (B, heads + 2 kv, Q, Dh)
        rotated, value = qkv[:, : heads + kv], qkv[:, heads + kv :]
        rotated = apply_rotary(rotated, cos, sin)
        query = rotated[:, :heads].to(attention_dtype)
        key, value = rotated[:, heads:].to(attention_dtype), value.to(attention_dtype)
        if cache is not None:
            key, value = cache.update(key, value, layer.index)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=layer.scaling,
                                             enable_gqa=kv != heads)  # (B, heads, Q, Dh)
        hidden = hidden + layer.out(out.transpose(1, 2).reshape(batch, rows, -1))
        gate, up = layer.gate_up(_rms_norm(hidden, second, eps2)).chunk(2, dim=-1)
        hidden = hidden + layer.down(layer.act(gate) * up)
    return hidden


def _or_causal(mask: torch.Tensor | None, rows: int, cached: int, device: torch.device) -> torch.Tensor | None:
    """The mask given, else the model's own causal mask for `rows` queries after `cached` keys ((Q, cached + Q)
    bool; None for one query, which sees every key)."""
    if mask is not None or rows == 1:
        return mask
    return torch.ones(rows, cached + rows, dtype=torch.bool, device=device).tril(cached)


class _Copies(torch.nn.Module):
    """Copies of a network's weights that run its forward (a module itself, so that what counts ops inside models'
    forwards counts these too); stale once a weight of the network changed."""

    def __init__(self, network: torch.nn.Module):
        super().__init__()
        self.int8_copies = _int8_copies()
        self._sources = [p for p in network.parameters()]
        self._versions = self._weights()

    def stale(self) -> bool:
        """Whether a weight changed since it was copied: in place (trained, loaded) or replaced (`.to()`)."""
        return self._weights() != self._versions

    def _weights(self) -> list[tuple[int, int]]:
        return [(p.data_ptr(), p._version) for p in self._sources]


class DraftForward(_Copies):
    """The draft's forward as the module docstring says, called like the model (`input_ids`, `position_ids`,
    `attention_mask`, the cache by either keyword, `logits_to_keep`); returns an object with `.logits` in
    float32."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        inner, packed = model.model, packing_applies(model)
        self.dtype = model.dtype
        self.attention_dtype = _attention_dtype(model)  # of the keys and values it caches, and of the queries
        with torch.no_grad():  # plain tensors (not inference ones): usable in and out of inference mode
            self.layers = [_Layer(layer, packed) for layer in inner.layers[: model.config.num_hidden_layers]]
            self.final_norm = (inner.norm.weight.detach().float(), inner.norm.variance_epsilon)
            self.head = _stacked([model.lm_head], packed)
        self.embedding = inner.embed_tokens
        self.rope = RopeTable(inner.rotary_emb, self.layers[0].head_dim)

    @torch.no_grad()  # a draft's guesses take no gradient
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache=None, past_key_values=None, use_cache: bool = True, output_hidden_states: bool = False,
                logits_to_keep: int = 0):
        assert not output_hidden_states, "a draft forward keeps no hidden states"
        cache = cache if cache is not None else past_key_values
        batch, rows = input_ids.shape  # (B, Q)
        cached = cache.get_seq_length() if cache is not None else 0
        cos, sin = self.rope(position_ids, cached + rows)  # every position is below the keys' count
        mask = _or_causal(attention_mask, rows, cached, input_ids.device)
        hidden = decoder_layers(self.embedding(input_ids).float(), self.layers, cos, sin, mask, cache,
                                self.attention_dtype)  # (B, Q, H)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        weight, eps = self.final_norm
        return SimpleNamespace(logits=self.head(_rms_norm(hidden, weight, eps)), hidden_states=None)  # float32


_HEADS: "weakref.WeakKeyDictionary[torch.nn.Module, HeadForward]" = weakref.WeakKeyDictionary()


def head_forward(head: torch.nn.Module) -> "HeadForward | None":
    """What runs a feature head (`opttree.step.drafters.head.FeatureHead`) when it drafts: a `HeadForward`, made once
    and again when a weight changed, or None where it does not apply (then the head's own forward runs)."""
    body = head.body
    if os.environ.get("OPTTREE_DRAFT_FORWARD", "1") == "0" or head.training \
            or body.config._attn_implementation not in ("sdpa", "eager") \
            or not _layers_apply(body.config, head, head.fc.weight.device):
        return None
    runner = _HEADS.get(head)
    if runner is None or runner.stale() or runner.int8_copies != _int8_copies():
        runner = _HEADS[head] = HeadForward(head)
    return runner


class HeadForward(_Copies):
    """A feature head's forward as `DraftForward` runs a draft's: the fused features (EAGLE-3) and the token's
    embedding through the head's input products, then its decoder layer (`decoder_layers`) and final norm, in
    float32, from stacked, packed, float32 or int8 copies of its weights (`_Product`), its keys and values cached in
    float32 where bf16 attention over one row is slow. On a 2-core AMD EPYC with avx512_bf16 the shipped head took
    ~1.3 ms a node through transformers' modules. Called as `FeatureHead.forward`; returns (B, Q, H) float32."""

    def __init__(self, head: torch.nn.Module):
        super().__init__(head)
        body, packed = head.body, packing_applies(head)
        dtype = head.fc.weight.dtype
        self.attention_dtype = torch.float32 if float32_attention_pays(body.layers[0].self_attn, dtype) else dtype
        with torch.no_grad():
            self.fuse = None if head.fuse is None else _stacked([head.fuse], packed)
            self.fc = _stacked([head.fc], packed)
            self.layers = [_Layer(layer, packed) for layer in body.layers]
            self.final_norm = (body.norm.weight.detach().float(), body.norm.variance_epsilon)
        self.rope = RopeTable(body.rotary_emb, self.layers[0].head_dim)

    @torch.no_grad()
    def forward(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                allowed: torch.Tensor | None = None, cache=None, own: bool = False) -> torch.Tensor:
        """features (B, Q, k H) (the target's layers), or with `own` (B, Q, H) (the head's outputs); embeds (B, Q, H);
        positions (B, Q); allowed (Q, cached + Q) bool, None for causal attention after the cache."""
        rows = embeds.shape[1]
        if self.fuse is not None and not own:
            features = self.fuse(features)
        x = self.fc(torch.cat([features.float(), embeds.float()], dim=-1))  # (B, Q, H)
        cached = cache.get_seq_length() if cache is not None else 0
        cos, sin = self.rope(positions, cached + rows)
        hidden = decoder_layers(x, self.layers, cos, sin, _or_causal(allowed, rows, cached, x.device), cache,
                                self.attention_dtype)
        weight, eps = self.final_norm
        return _rms_norm(hidden, weight, eps)
