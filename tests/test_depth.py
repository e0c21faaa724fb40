"""Depth control (issue 11, item 4): delta, fixed and Thompson sampling, exact with every policy and
source, and the Thompson rule against brute force."""

import pytest
import torch
from helpers import chi_square_pvalue, exact_joint, hf_greedy, sample_counts, tiny_model

import opttree
import opttree.engine
from opttree.depth import ThompsonDepth

PROMPT = torch.tensor([[1, 5, 7, 9, 11, 13]])


@pytest.fixture(scope="module")
def pair():
    return tiny_model(seed=0), tiny_model(seed=1, hidden=32, layers=1)


@pytest.mark.parametrize("control", ["fixed", "thompson"])  # delta: every other test
@pytest.mark.parametrize("tree,drafter,with_model", [
    ("opt", "model", True), ("opt", "recycling+lookup", False), ("dyspec", "model", True),
])
def test_greedy_output_is_exact_under_every_depth_control(pair, control, tree, drafter, with_model):
    target, draft = pair
    out = opttree.generate(target, PROMPT, draft if with_model else None, tree=tree, drafter=drafter, budget=8,
                           depth_control=control, max_new_tokens=32, eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(target, PROMPT, 32)), (control, tree, drafter)


def test_sampled_tokens_follow_the_target_distribution_under_thompson():
    target = tiny_model("llama", vocab=5, hidden=32, layers=1, seed=11, init=0.6)
    draft = tiny_model("llama", vocab=5, hidden=32, layers=1, seed=12, init=0.6)
    prompt, runs = torch.tensor([[1, 3, 0, 4]]), 1000
    counts = sample_counts(target, draft, prompt, 2, runs, tree="opt", budget=4, max_depth=2, temperature=1.0,
                           depth_control="thompson")
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 2), runs) > 1e-3


def layers_drafted(monkeypatch, *args, **kwargs) -> list[int]:
    """Draft layers run per step (root + expand calls of the draft model)."""
    from opttree.drafters.model import ModelDrafter

    layers = []
    root, expand = ModelDrafter.root, ModelDrafter.expand

    def counting_root(self, committed):
        layers.append(1)
        return root(self, committed)

    def counting_expand(self, tokens, parent_slots):
        layers[-1] += 1
        return expand(self, tokens, parent_slots)

    monkeypatch.setattr(ModelDrafter, "root", counting_root)
    monkeypatch.setattr(ModelDrafter, "expand", counting_expand)
    opttree.generate(*args, **kwargs)
    return layers


def test_fixed_drafts_max_depth_every_step_and_delta_may_stop_earlier(pair, monkeypatch):
    target, draft = pair
    options = dict(tree="opt", budget=8, max_depth=4, max_new_tokens=30, eos_token_id=[])
    fixed = layers_drafted(monkeypatch, target, PROMPT, draft, depth_control="fixed", **options)
    assert all(layers == 4 for layers in fixed[:-2])  # root + 3 expansions: the 4th layer is chosen, never run
    delta = layers_drafted(monkeypatch, target, PROMPT, draft, depth_control="delta", delta=0.9, **options)
    assert min(delta) < 4


def test_thompson_picks_the_depth_that_maximises_tokens_per_cost():
    """limit() = argmax over depths of tokens_per_cost at the sampled rate; checked against brute force
    with the sampler's own draws replayed."""
    import random

    control = ThompsonDepth(max_depth=8, seed=0, layer_cost=0.2)
    control.successes, control.failures = 7.0, 3.0
    replay = random.Random(0)
    for _ in range(20):
        rate = replay.betavariate(7.0, 3.0)
        values = {d: sum(rate**k for k in range(d + 1)) / (1 + 0.2 * d) for d in range(1, 9)}
        assert control.limit() == max(values, key=values.get)


def test_thompson_learns_deep_for_accepting_targets_and_shallow_for_rejecting_ones():
    deep, shallow = ThompsonDepth(8, seed=1), ThompsonDepth(8, seed=1)
    for _ in range(40):
        deep.observe(accepted=6, depth=6, draft_s=0.001, verify_s=0.03)
        shallow.observe(accepted=0, depth=3, draft_s=0.006, verify_s=0.03)
    deep_limits = [deep.limit() for _ in range(50)]
    shallow_limits = [shallow.limit() for _ in range(50)]
    assert min(deep_limits) >= 6 and max(shallow_limits) <= 1
    assert deep.layer_cost < 0.02 and 0.06 < shallow.layer_cost < 0.08  # a layer costs 1/180 and 1/15 of a verify


def test_an_unknown_depth_control_is_refused(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="depth_control must be one of delta, fixed, thompson"):
        opttree.generate(target, PROMPT, draft, depth_control="greedy", max_new_tokens=4)
