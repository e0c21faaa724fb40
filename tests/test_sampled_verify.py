"""Sampled verification of deterministic candidates on the device: the exponential race samples
exactly (1e5 draws), the verifier's emitted tokens follow the target exactly (enumerated, 2e4-4e4 draws),
both checks catch a planted bias of 1.5 % of probability mass, and a seed gives the same tokens
whatever tree the drafter offered."""

from collections import Counter

import pytest
import torch
from helpers import chi_square_pvalue, tiny_model

import opttree
from opttree.step.sampling import PositionNoise, Warp, race
from opttree.step.tree import DraftTree
from opttree.step.verify import accept_sampled

BIAS = 0.015  # probability mass a planted bug moves to token 0


def test_the_exponential_race_samples_exactly_and_the_check_sees_a_small_bias():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.30, 0.25, 0.15, 0.12, 0.08, 0.05, 0.03, 0.02])
    draws = 100_000
    noise = torch.empty(draws, 8).exponential_(generator=g).log()
    exact = {(i,): p for i, p in enumerate(probs.tolist())}

    def pvalue(p):
        counts = race(p.log().expand(draws, 8), noise).bincount(minlength=8)
        return chi_square_pvalue({(i,): int(c) for i, c in enumerate(counts)}, exact, draws)

    assert pvalue(probs) > 1e-3
    biased = (1 - BIAS) * probs + BIAS * torch.nn.functional.one_hot(torch.tensor(0), 8)
    assert pvalue(biased) < 1e-4


# A tree over a 4-token vocabulary: the root's children 0 and 1, node 0's children 2 and 3.
TREE = DraftTree(tokens=torch.tensor([0, 1, 2, 3]), parents=torch.tensor([-1, -1, 0, 0]),
                 depths=torch.tensor([1, 1, 2, 2]), scores=torch.zeros(4), draft_slots=torch.arange(4))
LOGITS = torch.tensor([[0.3, 0.9, -0.2, 0.1],  # root
                       [1.0, -0.5, 0.4, 0.0],  # node 0 (token 0)
                       [0.0, 0.2, 0.2, -1.0],  # node 1 (token 1)
                       [0.5, 0.5, 0.0, 0.1],  # node 2
                       [-0.3, 0.0, 0.6, 0.2]])  # node 3


def exact_first_two(logits: torch.Tensor, temperature: float) -> dict:
    """The exact distribution of (first emitted token, second or None): plain sampling at the root,
    then at the child node the first token leads to (a token with no node ends the step)."""
    p = (logits / temperature).softmax(-1)
    node_of = {0: 1, 1: 2}  # token at the root -> row of its node
    cells = {}
    for x in range(4):
        if x in node_of:
            for y in range(4):
                cells[(x, y)] = float(p[0, x] * p[node_of[x], y])
        else:
            cells[(x, None)] = float(p[0, x])
    return cells


def first_two(draws: int, temperature: float, bias: float = 0.0) -> Counter:
    g = torch.Generator().manual_seed(1)
    counts = Counter()
    for _ in range(draws):
        noise = torch.empty(5, 4).exponential_(generator=g).log()
        logits = LOGITS
        if bias and float(torch.rand((), generator=g)) < bias:
            noise = noise.clone()
            noise[0] = torch.tensor([-30.0, 0.0, 0.0, 0.0])  # the bug: the root "samples" token 0
        path, length, bonus = accept_sampled(TREE, logits, Warp(temperature), noise)
        emitted = TREE.tokens[path[: int(length)]].tolist() + [int(bonus)]
        counts[(emitted[0], emitted[1] if len(emitted) > 1 else None)] += 1
    return counts


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_verifier_emits_the_target_distribution(temperature):
    draws = 40_000 if temperature == 1.0 else 20_000  # the bias is looked for at temperature 1
    exact = exact_first_two(LOGITS, temperature)
    assert chi_square_pvalue(first_two(draws, temperature), exact, draws) > 1e-3
    if temperature == 1.0:
        assert chi_square_pvalue(first_two(draws, temperature, bias=BIAS), exact, draws) < 1e-4


def test_a_seed_gives_the_same_tokens_whatever_the_tree():
    """Deterministic candidates (children="top") are verified with noise drawn per position: the tokens
    of a seeded sampled generation do not depend on the policy, the drafter or the budget, and equal
    plain sampling's with the same seed. Sampled children: the same seed gives the same tokens again."""
    target = tiny_model("llama", vocab=48, hidden=32, layers=2, seed=3, init=0.5)
    draft = tiny_model("llama", vocab=48, hidden=32, layers=1, seed=4, init=0.5)
    prompt = torch.randint(3, 48, (1, 12), generator=torch.Generator().manual_seed(2))
    for seed in (0, 1):
        plain = opttree.generate(target, prompt, tree="ar", max_new_tokens=30, temperature=0.8, seed=seed,
                                 eos_token_id=[]).sequences
        for tree, drafter, budget in [("opt", "model", 4), ("opt", "model", 16), ("eagle2", "model", 8),
                                      ("opt", "recycling+lookup", 16), ("static", "model", 6), ("chain", "lookup", 5)]:
            out = opttree.generate(target, prompt, draft if "model" in drafter else None, tree=tree, drafter=drafter,
                                   budget=budget, max_new_tokens=30, temperature=0.8, seed=seed, eos_token_id=[],
                                   children="top")
            assert torch.equal(out.sequences, plain), (tree, drafter, budget, seed)
        for tree in ("opt", "eagle2", "dyspec"):  # sampled children: reproducible, not tied to plain sampling
            runs = [opttree.generate(target, prompt, draft, tree=tree, budget=8, max_new_tokens=30, temperature=0.8,
                                     seed=seed, eos_token_id=[], children="sampled").sequences for _ in range(2)]
            assert torch.equal(runs[0], runs[1]), (tree, seed)
        other = opttree.generate(target, prompt, tree="ar", max_new_tokens=30, temperature=0.8, seed=seed + 7,
                                 eos_token_id=[]).sequences
        assert not torch.equal(other, plain)  # the seed matters


def test_position_noise_is_drawn_once_per_position():
    g = torch.Generator().manual_seed(3)
    noise = PositionNoise(g, torch.device("cpu"))
    first = noise.rows(10, torch.arange(3), 3, 5).clone()  # positions 10, 11, 12
    again = noise.rows(11, torch.tensor([0, 1, 2, 3, 1]), 20, 5)  # 11, 12 kept; 13, 14 new; the ring grows
    assert torch.equal(again[:2], first[1:]) and torch.equal(again[4], again[1])
    reference = torch.rand(40, 5, generator=torch.Generator().manual_seed(3)).log().neg().log()
    assert torch.equal(again[:4], reference[1:5])
    later = noise.rows(29, torch.tensor([0, 1, 7]), 8, 5)  # positions 29, 30 and 36: drawn in order, wrapped
    assert torch.equal(later, reference[[19, 20, 26]])
    with pytest.raises(AssertionError):
        noise.rows(5, torch.arange(1), 1, 5)  # no going back
