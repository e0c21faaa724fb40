"""LongRoPE (Phi-3 long context): identical to `generate` when a generation crosses
original_max_position_embeddings, which switches the rope factors and makes Phi-3's generate recompute
its cache; the prompt below, at and past the switch."""

import pytest
import torch
from arch_configs import tiny
from helpers import hf_greedy, tiny_model

import opttree
from opttree.step.rope import longrope_threshold, rope_switch

SWITCH = 16


@pytest.fixture(scope="module")
def phi3():
    config = tiny("phi3", "sdpa").config
    head_dim = config.hidden_size // config.num_attention_heads
    g = torch.Generator().manual_seed(0)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
            "short_factor": (1 + torch.rand(head_dim // 2, generator=g)).tolist(),
            "long_factor": (2 + 4 * torch.rand(head_dim // 2, generator=g)).tolist(),
            "original_max_position_embeddings": SWITCH}
    target = tiny("phi3", "sdpa", rope_parameters=rope, max_position_embeddings=128,
                  original_max_position_embeddings=SWITCH, initializer_range=0.2)
    assert rope_switch(target.config) == SWITCH
    return target


@pytest.mark.parametrize("prompt_len", [6, 12, 16, 17, 25])  # crossing inside the generation, at the prefill, past it
def test_identical_across_the_switch(phi3, prompt_len):
    vocab = phi3.get_output_embeddings().weight.shape[0]
    prompt = (torch.arange(prompt_len)[None] * 7) % (vocab - 3) + 3
    reference = hf_greedy(phi3, prompt, 24, eos_token_id=[])
    draft = tiny_model("llama", vocab=vocab, hidden=32, layers=1, seed=3)
    for model_draft, options in [(phi3, {"budget": 8}), (draft, {"budget": 16, "static": True}), (None, {"budget": 8}),
                                 (None, {"tree": "ar"}), (draft, {"tree": "chain", "budget": 6})]:
        out = opttree.generate(phi3, prompt, model_draft, max_new_tokens=24, eos_token_id=[], **options)
        assert torch.equal(out.sequences, reference), (prompt_len, options)


def test_the_switch_changes_the_output(phi3):
    """The case is real: past the switch, generate's output differs from the short factors' alone."""
    vocab = phi3.get_output_embeddings().weight.shape[0]
    prompt = (torch.arange(12)[None] * 7) % (vocab - 3) + 3
    short = tiny("phi3", "sdpa", rope_parameters={**phi3.config.rope_parameters, "long_factor":
                                                  phi3.config.rope_parameters["short_factor"]},
                 max_position_embeddings=128, original_max_position_embeddings=SWITCH, initializer_range=0.2)
    assert not torch.equal(hf_greedy(phi3, prompt, 24, eos_token_id=[]), hf_greedy(short, prompt, 24, eos_token_id=[]))


def test_longrope_on_a_model_without_the_recompute_rule_is_refused_past_the_switch():
    llama = tiny_model("llama", seed=2)
    llama.config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                    "long_factor": [2.0] * 8, "original_max_position_embeddings": 8}
    assert longrope_threshold(llama.config) == 8 and rope_switch(llama.config) is None
    with pytest.raises(NotImplementedError, match="switches factors at original_max_position_embeddings=8"):
        opttree.generate(llama, torch.tensor([[1, 5, 7]]), max_new_tokens=10)
