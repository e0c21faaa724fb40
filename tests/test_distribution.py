"""Sampling is lossless: the first tokens follow the target's exact distribution."""


import pytest
import torch
from helpers import chi_square_pvalue, exact_joint, sample_counts, tiny_model

import opttree
import opttree.engine
from opttree.step.sampling import target_probs

VOCAB, STEPS, RUNS = 5, 3, 1500
FOLLOW_RUNS = 1000  # a check that sampling is exact; the check that must catch a bias keeps RUNS


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", vocab=VOCAB, hidden=32, layers=1, seed=11, init=0.6)
    draft = tiny_model("llama", vocab=VOCAB, hidden=32, layers=1, seed=12, init=0.6)
    prompt = torch.tensor([[1, 3, 0, 4]])
    return target, draft, prompt


@pytest.mark.parametrize("tree,budget,warp,int8", [
    ("opt", 4, {}, "0"),
    ("opt", 4, {}, "1"),  # the draft's products from int8 copies (`opttree.step.draft_forward`)
    ("opt", 3, {"top_p": 0.7}, "0"),
    ("opt", 4, {"top_k": 3}, "0"),
    ("chain", 2, {"temperature": 0.7}, "0"),
    ("opt", 4, {"temperature": 0.8, "min_p": 0.3, "typical_p": 0.9}, "0"),  # transformers' own warpers (min-p, ...)
])
def test_sampled_tokens_follow_the_target_distribution(pair, tree, budget, warp, int8, monkeypatch):
    target, draft, prompt = pair
    monkeypatch.setenv("OPTTREE_DRAFT_INT8", int8)
    warp = {"temperature": 1.0, **warp}
    exact = exact_joint(target, prompt, STEPS, **warp)
    counts = sample_counts(target, draft, prompt, STEPS, FOLLOW_RUNS, tree=tree, budget=budget, delta=0.0, max_depth=3,
                           **warp)
    assert chi_square_pvalue(counts, exact, FOLLOW_RUNS) > 1e-3


def test_the_check_detects_a_biased_acceptance_rule(pair, monkeypatch):
    """Test of the test: accepting the draft's first child a little too often is caught."""
    target, draft, prompt = pair
    original = opttree.engine.accept_path
    coin = torch.Generator().manual_seed(0)

    def biased(tree, logits, config, generator, noise, root_position, siblings):
        if len(tree) and float(torch.rand((), generator=coin)) < 0.15:
            # take the top draft token as if the target had sampled it, then a correct bonus after it
            bonus = torch.multinomial(target_probs(logits[1], config.warp), 1, generator=generator)
            return torch.zeros(len(tree), dtype=torch.long), torch.tensor(1), bonus.squeeze(0)
        return original(tree, logits, config, generator, noise, root_position, siblings)

    monkeypatch.setattr(opttree.engine, "accept_path", biased)
    exact = exact_joint(target, prompt, STEPS, temperature=1.0)
    counts = sample_counts(target, draft, prompt, STEPS, RUNS, tree="opt", budget=4, delta=0.0, max_depth=3, temperature=1.0)
    assert chi_square_pvalue(counts, exact, RUNS) < 1e-3
