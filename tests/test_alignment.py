"""The draft temperature: fitted by convex search, applied by the drafter, shaping OPT-Tree's trees."""

import pytest
import torch
from helpers import tiny_model

from opttree.alignment import draft_cross_entropy, fit_draft_temperature, paired_logits
from opttree.settings.config import SpecConfig
from opttree.step.drafters import ModelDrafter
from opttree.step.policies import make_policy


def synthetic_pairs(scale: float, noise: float = 0.0, positions: int = 3000, vocab: int = 12, seed: int = 0):
    """Target logits, and draft logits = scale x (target logits + noise): 1/scale times too sharp."""
    g = torch.Generator().manual_seed(seed)
    target = 2 * torch.randn(positions, vocab, generator=g)
    draft = scale * (target + noise * torch.randn(positions, vocab, generator=g))
    return [(target[:1000], draft[:1000]), (target[1000:], draft[1000:])]


@pytest.mark.parametrize("scale", [0.4, 1.0, 2.5])
def test_sampled_fit_recovers_the_scale(scale):
    """At temperature > 0 the soft cross-entropy is smallest where q = p: draft temperature = scale."""
    assert fit_draft_temperature(synthetic_pairs(scale), temperature=1.0) == pytest.approx(scale, rel=5e-3)


@pytest.mark.parametrize("scale,temperature", [(0.5, 0.0), (2.0, 0.0), (1.5, 0.7)])
def test_fit_is_the_brute_force_minimum(scale, temperature):
    pairs = synthetic_pairs(scale, noise=1.5, seed=3)  # a noisy draft: the optimum is inside the range
    t, d = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    grid = torch.linspace(0.05, 6, 1200).tolist()
    brute = min(grid, key=lambda tau: draft_cross_entropy(t, d, tau, temperature))
    fitted = fit_draft_temperature(pairs, temperature)
    assert fitted == pytest.approx(brute, rel=0.01)
    assert draft_cross_entropy(t, d, fitted, temperature) <= draft_cross_entropy(t, d, brute, temperature) + 1e-6


def test_greedy_fit_sharpens_an_under_confident_draft():
    """Labels are the target's argmax; a draft that ranks them first but spreads its mass (logits
    scaled down 5x) is under-confident, and the fit sharpens it (draft temperature < 1)."""
    assert fit_draft_temperature(synthetic_pairs(0.2, noise=1.0), temperature=0.0) < 0.5


def test_fit_needs_positions():
    with pytest.raises(ValueError, match="no positions"):
        fit_draft_temperature([(torch.zeros(0, 5), torch.zeros(0, 5))])


def test_paired_logits_are_both_models_on_the_targets_continuation():
    target = tiny_model("llama", seed=1, layers=1, hidden=32)
    draft = tiny_model("llama", seed=2, layers=1, hidden=32)
    prompt = torch.tensor([5, 9, 3])
    [(t, d)] = list(paired_logits(target, draft, [prompt], temperature=0.0, new_tokens=6))
    assert t.shape == d.shape == (6, target.config.vocab_size)
    ids = torch.cat([prompt, t.argmax(-1)])  # greedy: each row's argmax is the next token
    with torch.no_grad():
        assert torch.allclose(draft(input_ids=ids[None]).logits[0, 2:-1].float(), d, atol=1e-5)


def test_drafter_divides_logits_by_its_temperature():
    draft = tiny_model("llama", seed=2, layers=1, hidden=32)
    prompt = torch.tensor([5, 9, 3])
    with torch.no_grad():
        logits = draft(input_ids=prompt[None]).logits[0, -1].float()
    for tau in (0.5, 2.0):
        drafter = ModelDrafter(draft, tau)
        drafter.start(prompt)
        assert torch.allclose(drafter.root(prompt), torch.log_softmax(logits / tau, -1), atol=1e-5)
    with pytest.raises(ValueError, match="draft temperature"):
        ModelDrafter(draft, 0.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="draft_temperature"):
            SpecConfig(draft_temperature=bad)


def test_a_sharper_draft_grows_deeper_opt_trees():
    """OPT-Tree's shape follows p-hat: sharpening the same draft moves nodes from width to depth."""
    draft = tiny_model("llama", seed=2, layers=1, hidden=32)
    prompt = torch.tensor([5, 9, 3, 17, 4])
    depths = {}
    for tau in (0.25, 4.0):
        drafter = ModelDrafter(draft, tau)
        drafter.start(prompt)
        with torch.inference_mode():
            tree = make_policy(SpecConfig(budget=12, delta=0.0, max_depth=8)).build(drafter, prompt, 8)
        depths[tau] = tree.max_depth
    assert depths[0.25] > depths[4.0]


def test_reliability_table_shows_the_calibration():
    from opttree.alignment import reliability

    exact = reliability([(t, t) for t, _ in synthetic_pairs(1.0)])  # the target as its own draft
    assert sum(row["positions"] for row in exact) == 3000
    assert all(row["accepted"] == 1.0 for row in exact if row["positions"])
    assert all(row["from"] <= row["stated"] < row["to"] + 1e-9 for row in exact if row["positions"])

    pairs = synthetic_pairs(0.2, noise=1.0)  # under-confident: states less than it achieves

    def gap(rows):  # position-weighted |stated - accepted|
        return sum(r["positions"] * abs(r["stated"] - r["accepted"]) for r in rows if r["positions"]) / 3000

    raw, calibrated = reliability(pairs), reliability(pairs, fit_draft_temperature(pairs))
    assert all(r["stated"] < r["accepted"] for r in raw if r["positions"] > 100)
    assert gap(calibrated) < gap(raw) / 2


def test_a_draft_temperature_with_a_custom_drafter_is_an_error():
    from helpers import ScriptedDrafter

    import opttree

    target = tiny_model("llama", seed=1, layers=1, hidden=32)
    with pytest.raises(ValueError, match="custom Drafter"):
        opttree.generate(target, torch.tensor([5, 9]), ScriptedDrafter(vocab=target.config.vocab_size),
                         draft_temperature=0.5, max_new_tokens=4)
