"""Certification: every model the engine accepts is exact; the rest is refused by name, up front."""

from __future__ import annotations

import pytest
import torch
from arch_configs import tiny_any_attention
from helpers import hf_greedy, tiny_model

import opttree
from opttree.certify import probe

PROMPT = torch.tensor([[1, 5, 7, 9, 11, 13]])


def refusal(model, max_new_tokens: int = 30, budget: int = 4) -> str:
    with pytest.raises(NotImplementedError) as info:
        opttree.generate(model, PROMPT, model, max_new_tokens=max_new_tokens, eos_token_id=[], budget=budget)
    return str(info.value)


def exact(model, max_new_tokens: int = 30, budget: int = 4) -> bool:
    out = opttree.generate(model, PROMPT, model, max_new_tokens=max_new_tokens, eos_token_id=[], budget=budget)
    return torch.equal(out.sequences, hf_greedy(model, PROMPT, max_new_tokens))


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}


def test_phi3_longrope_is_exact_below_and_across_the_original_length():  # symptom 1 (tests/test_rope.py)
    model = tiny_model("phi3", max_positions=256, original_max_position_embeddings=32, rope_parameters=dict(LONGROPE))
    assert exact(model, max_new_tokens=40)  # 6 + 40 > 32: crosses
    assert exact(model, max_new_tokens=26)  # 6 + 26 = 32: never crosses


def test_gpt_neo_local_window_is_exact_past_the_window():  # symptom 3: run as chains (`opttree.step.chains`)
    model = tiny_any_attention("gpt_neo", window_size=32)  # layers: global, local
    assert exact(model, max_new_tokens=30)  # 6 + 30 + budget 4 + 1 rows > 32
    assert exact(model, max_new_tokens=20)


def test_gpt_neo_causal_buffer_is_not_overrun_by_the_tree():  # symptom 3: crash close to the context
    model = tiny_any_attention("gpt_neo", max_position_embeddings=40)
    message = refusal(model, max_new_tokens=30, budget=16)  # 36 tokens + 17 tree rows > 40
    assert "buffer of 40 key rows" in message


@pytest.mark.parametrize("model_type, extra", [("mpt", {}), ("bloom", {}), ("falcon", {"alibi": True})])
def test_alibi_is_exact_as_chains(model_type, extra):  # symptom 4 (tests/test_index_attention.py)
    assert exact(tiny_any_attention(model_type, **extra))


def test_alibi_is_caught_by_the_probe_alone():
    """The tree probe does not rely on the named reasons: it sees that a tree forward of ALiBi is not exact
    (which is why such models run as chains)."""
    assert "differ" in probe(tiny_any_attention("mpt"), 32)
    assert probe(tiny_model("llama"), 32) is None


@pytest.mark.parametrize("model_type", ["bart", "mbart", "marian", "pegasus", "blenderbot", "plbart", "mvp",
                                        "trocr"])
def test_positions_from_the_cache_length_are_exact_as_chains(model_type):  # symptom 5
    assert exact(tiny_any_attention(model_type))


def test_bucketed_attention_is_refused_even_for_plain_decoding():  # symptom 6
    model = tiny_any_attention("reformer", is_decoder=True, axial_pos_embds=False)
    with pytest.raises(NotImplementedError, match="hash buckets"):
        opttree.generate(model, PROMPT, tree="ar", max_new_tokens=8, eos_token_id=[])


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_bidirectional_encoders_are_refused_and_decoders_exact(model_type):  # symptom 7
    assert "bidirectional" in refusal(tiny_any_attention(model_type))
    assert exact(tiny_any_attention(model_type, is_decoder=True), max_new_tokens=12)


@pytest.mark.parametrize("model_type", ["openai-gpt", "xlm", "cpmant"])
def test_models_without_a_positioned_kv_cache_are_refused_clearly(model_type):  # symptom 11
    assert "its forward takes no" in refusal(tiny_any_attention(model_type))


def test_a_layer_type_tree_masks_cannot_drive_is_named_as_such():
    model = tiny_model("llama", seed=6)
    model.config.layer_types = ["recurrent", "full_attention"]  # a kind outside transformers' cache layers
    message = refusal(model)
    assert "'recurrent': recurrent layers" in message and "linear attention" not in message


def test_a_model_that_crashes_in_the_tree_forward_is_refused_by_name(monkeypatch):
    model = tiny_model("llama", hidden=48)  # a configuration no other test has certified (the probe is cached)

    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch deep inside")

    monkeypatch.setattr(model.model, "forward", broken)
    message = refusal(model)
    assert "LlamaForCausalLM" in message and "shape mismatch deep inside" in message
