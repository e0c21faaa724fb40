"""Function-preserving inflation: a Llama target made wider and deeper, computing the same function.

A realistic GPU testbed without a model hub: the shipped 29.5M target is
launch-bound on a GPU, so its speedups say nothing about a 1B model. Inflating it keeps its tokens
(and so the shipped draft's acceptance) while every forward pays a 1B model's matrix products:

- hidden width h -> H: the residual stream's extra dimensions stay exactly zero (zero embedding
  columns, zero rows in every output projection);
- RMSNorm over H dimensions divides by sqrt(h/H)-smaller statistics: weights scaled by sqrt(h/H)
  and epsilon by h/H give the same output on the original dimensions;
- extra attention heads (same head_dim, same query/key grouping) and MLP units get random input
  weights and zero output weights; extra layers get zero output projections (identity blocks).

Exact up to floating-point summation order (RMSNorm's mean runs over more zeros).
"""

from __future__ import annotations

import math

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel


def inflate(model: PreTrainedModel, hidden: int, intermediate: int, layers: int,
            device: torch.device | str = "cpu") -> PreTrainedModel:
    """A Llama model of width `hidden`, MLP width `intermediate` and `layers` layers, computing `model`'s function."""
    cfg = model.config
    if cfg.model_type != "llama":
        raise NotImplementedError(f"inflate supports Llama models, got model_type={cfg.model_type!r}")
    h, inter, n_layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    if hidden < h or intermediate < inter or layers < n_layers or hidden % (head_dim * group):
        raise ValueError(f"inflate to hidden >= {h} (a multiple of {head_dim * group}), intermediate >= {inter}, "
                         f"layers >= {n_layers}; got {hidden}, {intermediate}, {layers}")
    big_cfg = cfg.__class__(**{**cfg.to_dict(), "hidden_size": hidden, "intermediate_size": intermediate,
                               "num_hidden_layers": layers, "num_attention_heads": hidden // head_dim,
                               "num_key_value_heads": hidden // head_dim // group, "head_dim": head_dim,
                               "rms_norm_eps": cfg.rms_norm_eps * h / hidden})
    with torch.device(device):
        big = AutoModelForCausalLM.from_config(big_cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    src, dst = model.float().state_dict(), big.state_dict()
    norm_scale = math.sqrt(h / hidden)
    q_rows, kv_rows = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    with torch.no_grad():
        for name, big_w in dst.items():
            if "o_proj" in name or "down_proj" in name:  # output projections: only the original block
                big_w.zero_()
            if name not in src:  # an extra layer: random inputs, zero outputs = an identity block
                continue
            w = src[name].to(big_w.device)
            if name.endswith("norm.weight"):
                big_w.zero_()
                big_w[:h] = w * norm_scale
            elif "q_proj" in name or "k_proj" in name or "v_proj" in name:
                rows = q_rows if "q_proj" in name else kv_rows
                big_w[:rows].zero_()
                big_w[:rows, :h] = w
            elif "gate_proj" in name or "up_proj" in name:
                big_w[:inter].zero_()
                big_w[:inter, :h] = w
            elif "o_proj" in name:
                big_w[:h, :q_rows] = w
            elif "down_proj" in name:
                big_w[:h, :inter] = w
            elif "embed_tokens" in name or "lm_head" in name:
                big_w.zero_()
                big_w[:, :h] = w
            else:
                raise NotImplementedError(f"inflate does not know how to widen {name} {tuple(w.shape)}")
    return big
