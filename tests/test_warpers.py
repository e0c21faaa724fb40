"""opttree's warping is transformers' own: every sampling warper `generate` builds (temperature, top-h, top-k,
top-p, min-p, typical, epsilon, eta), alone and together, gives the same scores element for element, ties and
top-p's edges included, and is read from a generation_config or a custom_generate call as generate reads it."""

import math

import pytest
import torch
from helpers import tiny_model
from transformers import GenerationConfig
from transformers.generation import logits_process as lp

import opttree
from opttree.genconfig import sampling_settings
from opttree.settings.config import SpecConfig
from opttree.step.sampling import Warp, warp_logits

V = 64


def rows() -> torch.Tensor:
    """(8, V) logits with what breaks warpers: ties, a uniform row (top-p's cumulative sums land on its cut
    exactly), a peaked row, -inf entries (a processor's bans), a row of two likely tokens."""
    g = torch.Generator().manual_seed(0)
    out = 3 * torch.randn(8, V, generator=g)
    out[1] = (out[1] * 2).round() / 2  # many ties
    out[2] = 0.0  # uniform: cumulative probabilities k / 64, exact in float32
    out[3, 5] = 40.0  # one token holds nearly all the mass
    out[4, ::3] = float("-inf")
    out[5] = torch.where(torch.arange(V) < 2, 5.0, -5.0)
    out[6, :32] = out[6, 32:]  # every value twice
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab=V, hidden=32, layers=1)


def transformers_warped(model, logits: torch.Tensor, settings: dict) -> torch.Tensor:
    """The warpers `generate(do_sample=True, **settings)` builds, in its order, applied to `logits`."""
    config = GenerationConfig(do_sample=True, **{"temperature": 1.0, "top_k": 0, "top_p": 1.0, **settings})
    return model._get_logits_processor(config, logits_processor=lp.LogitsProcessorList(), device="cpu")(None, logits)


CASES = [
    dict(temperature=0.7), dict(top_k=5), dict(top_k=1), dict(top_p=0.5), dict(top_p=0.9), dict(top_p=0.25),
    dict(top_p=1e-8),  # 1 - top_p rounds to 1 in float32: only the keep-the-top rule leaves a token
    dict(min_p=0.05), dict(min_p=0.3), dict(min_p=1.0), dict(typical_p=0.5), dict(typical_p=0.95),
    dict(epsilon_cutoff=3e-3), dict(epsilon_cutoff=0.02), dict(eta_cutoff=1e-3), dict(eta_cutoff=0.05),
    dict(top_h=0.4), dict(top_h=1.0),
    dict(temperature=0.6, top_k=20, top_p=0.9, min_p=0.05),  # a usual mix: the order matters here
    dict(temperature=1.3, top_p=0.8, min_p=0.2, typical_p=0.9),
    dict(temperature=0.8, top_h=0.6, top_k=10, epsilon_cutoff=0.01, eta_cutoff=0.01),
    dict(temperature=0.5, top_k=12, top_p=0.7, min_p=0.1, typical_p=0.8, epsilon_cutoff=1e-3, eta_cutoff=1e-3,
         top_h=0.9),
]


@pytest.mark.parametrize("settings", CASES, ids=lambda s: ",".join(f"{k}={v:g}" for k, v in s.items()))
def test_warping_is_transformers_own(model, settings):
    logits = rows()
    ours = warp_logits(logits, SpecConfig(**{"temperature": 1.0, **settings}).warp)
    torch.testing.assert_close(ours, transformers_warped(model, logits, settings), rtol=0, atol=0)
    assert torch.isinf(ours).any() or settings == dict(temperature=0.7)  # each case filters something
    # any leading shape: a tree's (N + 1, V), a batch's (B, N + 1, V)
    torch.testing.assert_close(warp_logits(logits.view(2, 4, V), SpecConfig(**{"temperature": 1.0, **settings}).warp),
                               ours.view(2, 4, V), rtol=0, atol=0)


def test_the_comparison_sees_a_warper_out_of_order(model):
    """Test of the test: min-p before top-p (not generate's order) differs on these rows."""
    logits, settings = rows(), dict(top_p=0.6, min_p=0.2)
    swapped = lp.TopPLogitsWarper(0.6)(None, lp.MinPLogitsWarper(0.2)(None, logits.clone()))
    assert not torch.equal(torch.isinf(swapped), torch.isinf(transformers_warped(model, logits, settings)))


def test_the_warpers_from_a_generation_config_and_a_custom_generate_call():
    target = tiny_model("llama", vocab=V, hidden=32, layers=1)
    saved = target.generation_config
    target.generation_config = GenerationConfig(do_sample=True, temperature=0.8, top_k=0, min_p=0.1, typical_p=0.9,
                                                epsilon_cutoff=0.0, eta_cutoff=2e-3, top_h=0.5)
    try:
        run = opttree.stream(target, torch.tensor([[1, 2, 3]]), None, max_new_tokens=2)
        assert run.config.warp == Warp(0.8, 0, 1.0, 0.1, 0.9, 0.0, 2e-3, 0.5)
        # the caller's own setting wins, as in generate; greedy applies none
        assert opttree.stream(target, torch.tensor([[1, 2, 3]]), None, max_new_tokens=2, min_p=0.3).config.min_p == 0.3
        assert opttree.stream(target, torch.tensor([[1, 2, 3]]), None, max_new_tokens=2, temperature=0).config.greedy
    finally:
        target.generation_config = saved
    prepared = [lp.TemperatureLogitsWarper(0.7), lp.TopHLogitsWarper(0.5), lp.MinPLogitsWarper(0.05),
                lp.TypicalLogitsWarper(0.9), lp.EpsilonLogitsWarper(1e-3), lp.EtaLogitsWarper(2e-3)]
    settings = sampling_settings(prepared, do_sample=True)
    assert settings == dict(temperature=0.7, top_k=0, top_p=1.0, top_h=0.5, min_p=0.05, typical_p=0.9,
                            epsilon_cutoff=1e-3, eta_cutoff=pytest.approx(2e-3))
    with pytest.raises(ValueError, match="min_p with min_tokens_to_keep > 1"):
        sampling_settings([lp.MinPLogitsWarper(0.1, min_tokens_to_keep=2)], do_sample=True)


@pytest.mark.parametrize("name,value,allowed", [
    ("min_p", -0.1, "[0, 1]"), ("min_p", 1.5, "[0, 1]"), ("typical_p", 0.0, "(0, 1]"),
    ("epsilon_cutoff", 1.0, "[0, 1)"), ("eta_cutoff", math.nan, "[0, 1)"), ("top_h", "0.5", "[0, 1]"),
    ("min_p", True, "[0, 1]"),
])
def test_a_warper_out_of_its_range_is_refused_by_name(name, value, allowed):
    with pytest.raises(ValueError, match=rf"{name} must be in \{allowed[0]}0, 1\{allowed[-1]}"):
        SpecConfig(temperature=1.0, **{name: value})
