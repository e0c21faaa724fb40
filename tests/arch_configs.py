"""Tiny random configs for any causal-LM architecture transformers ships (for the architecture sweep)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 96
# Size attributes set wherever a config has them (different architectures spell them differently).
SMALL = {
    "vocab_size": VOCAB, "hidden_size": 64, "n_embd": 64, "d_model": 64, "n_embed": 64, "dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "d_ff": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "decoder_layers": 2, "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "n_positions": 256,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "initializer_range": 0.2, "init_std": 0.2,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "rotary_dim": 8,
    "linear_num_heads": 4, "linear_head_dim": 16,  # linear-attention layers (Kimi Linear)
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
}
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")


# what an architecture's default leaves unset and its model needs
OWN = {
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),  # no layer pattern
    # Gemma 3n: per-layer inputs at full vocabulary size, and 15 layers that reuse others' keys (of 2)
    "gemma3n_text": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                         num_kv_shared_layers=2, activation_sparsity_pattern=[0.0] * 4, vocab_size_per_layer_input=96,
                         hidden_size_per_layer_input=16, laurel_rank=8),
    "nemotron": dict(num_key_value_heads=2),  # None, which its attention divides by
    # DBRX: its default attention config has no rope_theta or clip_qkv, both of which its attention reads
    "dbrx": dict(attn_config={"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}),
    "qwen4_exp_text": dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=2),  # its sparse attention's sizes
}


def tiny_config(model_type: str, **extra):
    """The architecture's default config with every size attribute it has made small (passed to the
    constructor, so derived attributes follow)."""
    default = _GlobalView(AutoConfig.for_model(model_type))
    small = {name: value for name, value in SMALL.items() if _is_int(getattr(default, name, None))}
    if hasattr(default, "qk_rope_head_dim"):
        small.pop("head_dim", None)  # MLA: head_dim is the rope part, keys have one head per query head
        small["num_key_value_heads"] = small.get("num_attention_heads", 4)
    elif hasattr(default, "head_dim") and default.head_dim is None:  # Ministral, Hunyuan: None = derive it
        small["head_dim"] = SMALL["hidden_size"] // SMALL["num_attention_heads"]  # ... which their attention does not
    if getattr(default, "num_experts_per_tok", 0) is None and any(name in small for name in EXPERT_COUNTS):
        small["num_experts_per_tok"] = 2  # DeepSeek-V2's default leaves it unset (its checkpoints set 6)
    if _is_int(getattr(default, "attention_hidden_size", None)):
        small["attention_hidden_size"] = 64
    # per-layer patterns: each kind once, in the order it first appears, so a hybrid keeps its attention
    # layer (Qwen3.5 / Qwen3-Next: [linear, full]; two layers from the default's start would be both linear)
    kinds = {name: list(dict.fromkeys(getattr(default, name))) for name in ("layer_types", "mlp_layer_types")
             if isinstance(getattr(default, name, None), list) and getattr(default, name)}
    layers = max([2, *map(len, kinds.values())])
    for name, pattern in kinds.items():
        small[name] = (pattern * layers)[:layers]
    if layers > 2:
        small.update({name: layers for name in LAYER_COUNTS if name in small})
    for name, token in (("bos_token_id", 1), ("eos_token_id", 2), ("pad_token_id", 0), ("decoder_start_token_id", 0)):
        if hasattr(default, name):
            small[name] = token
    if isinstance(getattr(default, "attention_types", None), list):  # GPT-Neo: one entry per layer
        small["attention_types"] = [[["global", "local"], 1]]
    derived = [name for name in small if isinstance(getattr(type(default.config), name, None), property)]
    for name in derived:  # computed from other attributes: not a constructor argument
        small.pop(name)
    small.update(OWN.get(model_type, {}))
    small.update(extra)
    return AutoConfig.for_model(model_type, **small)


class _GlobalView:
    """A config's attributes, the global value where it declares one per layer (Gemma 4's `head_dim`,
    which transformers refuses to read globally): what the constructor takes."""

    def __init__(self, config):
        self.config = config

    def __getattr__(self, name):
        try:
            return getattr(self.config, name)
        except AttributeError:
            raise
        except Exception:  # transformers' ambiguous per-layer attribute
            return self.config.to_dict().get(name)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tiny(model_type: str, attn: str = "sdpa", seed: int = 0, **extra):
    """A tiny fp32 model; ValueError if the architecture does not support `attn`."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **extra)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()


def tiny_any_attention(model_type: str, seed: int = 0, **extra):
    """sdpa where the architecture supports it, else eager."""
    try:
        return tiny(model_type, "sdpa", seed, **extra)
    except ValueError:
        return tiny(model_type, "eager", seed, **extra)
