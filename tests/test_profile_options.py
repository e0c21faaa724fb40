"""`opttree.profile_options(target, draft)` gives settings that `opttree.generate(target, ids, draft, **options)`
runs with, whatever the pair's calibration profile chose: draft sources with the draft model, sources
without it, plain decoding, or no choice of sources at all (the shipped profile)."""

from __future__ import annotations

import pytest
import torch

import opttree
from opttree import profiles
from helpers import hf_greedy, tiny_model

GREEDY_TAU, SAMPLED_TAU = 0.5, 1.2


@pytest.fixture
def pair(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path))  # the profile written below is this test's only
    return tiny_model("llama", seed=0), tiny_model("llama", seed=1, layers=1, hidden=32)


def write_profile(target, draft, **recommended) -> None:
    """A calibration profile as `opttree calibrate` writes it, with the fields profile_options reads."""
    profiles.save_profile({
        "version": profiles.PROFILE_VERSION,
        "key": profiles.profile_key(target, draft),
        "recommended": {"budget": 4, "delta": 0.3, **recommended},
        profiles.DRAFT_TEMPERATURE_FIELD: {"greedy": GREEDY_TAU, "sampled": SAMPLED_TAU},
    })


def runs_exactly(target, draft, options) -> None:
    """generate() with the draft and the options gives the target's greedy output."""
    prompt = torch.tensor([[1, 5, 9, 14, 3]])
    out = opttree.generate(target, prompt, draft, max_new_tokens=12, eos_token_id=[], **options)
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 12, eos_token_id=[]))


def test_sources_with_the_draft_model_are_applied(pair):
    target, draft = pair
    write_profile(target, draft, tree="opt", drafter="model+lookup", drafter_budget=8, why="fastest measured")
    options = opttree.profile_options(target, draft)
    assert options == {"draft_temperature": GREEDY_TAU, "budget": 8, "delta": 0.3, "drafter": "model+lookup"}
    runs_exactly(target, draft, options)


@pytest.mark.parametrize("recommended", [
    dict(tree="opt", drafter="recycling+lookup", drafter_budget=16, why="fastest measured"),  # AVX2 CPUs' first use
    dict(tree="opt", drafter="lookup", drafter_budget=8, why="fastest measured"),
    dict(tree="ar", drafter=None, why="no draft source beat plain decoding"),
], ids=["recycling+lookup", "lookup", "ar"])
def test_a_choice_without_the_draft_model_gives_the_draft_models_settings(pair, recommended):
    """The call passes the draft, which a source without 'model' would refuse: the draft model's
    calibrated budget, delta and draft temperature come back, and generate runs with them."""
    target, draft = pair
    write_profile(target, draft, **recommended)
    options = opttree.profile_options(target, draft)
    assert options == {"draft_temperature": GREEDY_TAU, "budget": 4, "delta": 0.3}
    runs_exactly(target, draft, options)
    sampled = opttree.profile_options(target, draft, temperature=1.0)
    assert sampled["draft_temperature"] == SAMPLED_TAU


def test_a_profile_without_a_choice_of_sources(pair):
    """Like the shipped profile: budget, delta and draft temperature only."""
    target, draft = pair
    write_profile(target, draft)
    options = opttree.profile_options(target, draft)
    assert options == {"draft_temperature": GREEDY_TAU, "budget": 4, "delta": 0.3}
    runs_exactly(target, draft, options)


def test_no_profile_or_no_draft_gives_nothing(pair):
    target, draft = pair
    assert opttree.profile_options(target, draft) == {}
    write_profile(target, draft, tree="opt", drafter="model", drafter_budget=8, why="fastest measured")
    assert opttree.profile_options(target, None) == {}


def test_sampling_takes_the_measured_acceptance_by_draw_rank(pair):
    """A profile's acceptance vector for sampling reaches the policies that value sampled children by it (opt,
    eagle2) at temperature > 0, and Sequoia at either temperature; greedy OPT-Tree never takes it."""
    from opttree.step.policies import sequoia

    target, draft = pair
    write_profile(target, draft)
    path = profiles.profile_path(target, draft)
    profile = __import__("json").loads(path.read_text())
    profile[sequoia.PROFILE_FIELD] = {"greedy": [0.8, 0.1], "sampled": [0.6, 0.2, 0.1]}
    profiles.save_profile(profile)
    assert profiles.profile_options(target, draft, "opt", 1.0)["acceptance"] == (0.6, 0.2, 0.1)
    assert profiles.profile_options(target, draft, "eagle2", 0.7)["acceptance"] == (0.6, 0.2, 0.1)
    assert profiles.profile_options(target, draft, "sequoia", 0.0)["acceptance"] == (0.8, 0.1)
    assert "acceptance" not in profiles.profile_options(target, draft, "opt", 0.0)
    assert "acceptance" not in profiles.profile_options(target, draft, "dyspec", 1.0)
    out = opttree.generate(target, torch.tensor([[1, 5, 9]]), draft, max_new_tokens=8, temperature=1.0, seed=0,
                           **opttree.profile_options(target, draft, temperature=1.0))
    assert out.stats.new_tokens == 8
