"""Depth control: delta, fixed, Thompson sampling and AdaEAGLE's length predictor,
exact with every policy and source, the Thompson and predictor rules against brute force, and a
predictor that learns what decides the accepted length."""

import pytest
import torch
from helpers import chi_square_pvalue, exact_joint, hf_greedy, sample_counts, tiny_model

import opttree
import opttree.engine
from opttree.step.depth import PredictorDepth, ThompsonDepth
from opttree.step.length import LengthPredictor

PROMPT = torch.tensor([[1, 5, 7, 9, 11, 13]])


@pytest.fixture(scope="module")
def pair():
    return tiny_model(seed=0), tiny_model(seed=1, hidden=32, layers=1)


@pytest.fixture(scope="module")
def predictor(pair, tmp_path_factory):
    torch.manual_seed(0)
    target = pair[0]
    return LengthPredictor(target.config.hidden_size, 6).save(tmp_path_factory.mktemp("length"), target)


@pytest.mark.parametrize("control", ["fixed", "thompson", "predictor"])  # delta: every other test
@pytest.mark.parametrize("tree,drafter,with_model", [
    ("opt", "model", True), ("opt", "recycling+lookup", False), ("dyspec", "model", True),
])
def test_greedy_output_is_exact_under_every_depth_control(pair, predictor, control, tree, drafter, with_model):
    target, draft = pair
    out = opttree.generate(target, PROMPT, draft if with_model else None, tree=tree, drafter=drafter, budget=8,
                           depth_control=control, max_new_tokens=32, eos_token_id=[],
                           length_predictor=predictor if control == "predictor" else None)
    assert torch.equal(out.sequences, hf_greedy(target, PROMPT, 32)), (control, tree, drafter)


@pytest.mark.parametrize("control", ["thompson", "predictor"])
def test_sampled_tokens_follow_the_target_distribution(control, tmp_path):
    target = tiny_model("llama", vocab=5, hidden=32, layers=1, seed=11, init=0.6)
    draft = tiny_model("llama", vocab=5, hidden=32, layers=1, seed=12, init=0.6)
    extra = {"length_predictor": LengthPredictor(32, 2).save(tmp_path, target)} if control == "predictor" else {}
    prompt, runs = torch.tensor([[1, 3, 0, 4]]), 3000
    counts = sample_counts(target, draft, prompt, 2, runs, tree="opt", budget=4, max_depth=2, temperature=1.0,
                           depth_control=control, **extra)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 2), runs) > 1e-3


def layers_drafted(monkeypatch, *args, **kwargs) -> list[int]:
    """Draft layers run per step (root + expand calls of the draft model)."""
    from opttree.step.drafters.model import ModelDrafter

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
        assert control.limit(None, None) == max(values, key=values.get)


def test_thompson_learns_deep_for_accepting_targets_and_shallow_for_rejecting_ones():
    deep, shallow = ThompsonDepth(8, seed=1), ThompsonDepth(8, seed=1)
    for _ in range(40):
        deep.observe(accepted=6, depth=6, draft_s=0.001, verify_s=0.03)
        shallow.observe(accepted=0, depth=3, draft_s=0.006, verify_s=0.03)
    deep_limits = [deep.limit(None, None) for _ in range(50)]
    shallow_limits = [shallow.limit(None, None) for _ in range(50)]
    assert min(deep_limits) >= 6 and max(shallow_limits) <= 1
    assert deep.layer_cost < 0.02 and 0.06 < shallow.layer_cost < 0.08  # a layer costs 1/180 and 1/15 of a verify


def test_an_unknown_depth_control_is_refused(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="depth_control must be one of delta, fixed, thompson, predictor"):
        opttree.generate(target, PROMPT, draft, depth_control="greedy", max_new_tokens=4)
    with pytest.raises(ValueError, match="opttree train length-predictor"):
        opttree.generate(target, PROMPT, draft, depth_control="predictor", max_new_tokens=4)


def test_a_predictor_without_its_control_or_for_another_target_is_refused(pair, predictor):
    target, draft = pair
    with pytest.raises(ValueError, match="use depth_control='predictor'"):
        opttree.generate(target, PROMPT, draft, length_predictor=predictor, max_new_tokens=4)
    with pytest.raises(ValueError, match="trained for another target"):
        opttree.generate(tiny_model(seed=5), PROMPT, draft, depth_control="predictor", length_predictor=predictor,
                         max_new_tokens=4)


def test_the_predictor_drafts_the_depth_that_maximises_tokens_per_cost(pair, predictor):
    """limit() = argmax_d (1 + sum_k<=d P(A >= k)) / (1 + d c), with P(A >= k) summed by hand from the
    network's distribution over 0..D for this root and feature."""
    from opttree.step.length import load_length_predictor

    target = pair[0]
    network = load_length_predictor(predictor, target)
    control = PredictorDepth(network, target, max_depth=6)
    control.layer_cost = 0.15
    for root in range(3, 9):
        feature = torch.randn(target.config.hidden_size, generator=torch.Generator().manual_seed(root))
        with torch.no_grad():
            p = torch.softmax(network(feature[None], target.get_input_embeddings()(torch.tensor([root]))), -1)[0]
        reach = [float(p[k:].sum()) for k in range(1, 7)]
        values = {d: (1 + sum(reach[:d])) / (1 + 0.15 * d) for d in range(1, 7)}
        assert control.limit(torch.tensor(root), feature) == max(values, key=values.get)


def test_logged_steps_are_the_runs_steps_and_a_predictor_learns_what_decides_the_length(pair):
    """The log of a fixed-depth run has one row per full-depth step, with the accepted counts the run's
    stats record; a predictor fitted to lengths that depend on the root token predicts them on held-out
    rows far better than a constant."""
    from opttree.train.length import fit_length_predictor, logged_steps

    target, draft = pair
    options = dict(tree="opt", budget=6, max_depth=3, max_new_tokens=40, eos_token_id=[])
    logged = logged_steps(target, draft, [PROMPT[0], PROMPT[0, :3]], options, "test")
    runs = [opttree.generate(target, p, draft, depth_control="fixed", **options).stats for p in (PROMPT, PROMPT[:, :3])]
    assert 0 < logged["accepted"].numel() <= sum(s.steps for s in runs)
    assert int(logged["accepted"].sum()) <= sum(s.accepted_tokens for s in runs)
    assert logged["feature"].shape == (logged["accepted"].numel(), target.config.hidden_size)
    roots = torch.randint(3, 96, (1200,), generator=torch.Generator().manual_seed(0))
    synthetic = {"feature": torch.randn(1200, target.config.hidden_size), "root": roots, "accepted": roots % 4,
                 "prompt": torch.arange(1200) // 20}
    split = lambda rows: {k: v[rows] for k, v in synthetic.items()}  # noqa: E731
    _, scores = fit_length_predictor(target, split(slice(0, 1000)), split(slice(1000, None)), 3, epochs=40,
                                     log=lambda *_: None)
    assert scores["accuracy"] > 0.7 and scores["constant_accuracy"] < 0.4, scores  # measured: 0.81, 0.27
