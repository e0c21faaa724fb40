"""Batch-level OPT-Tree: one node budget for every row's candidate tree (`tree.allocate`), against brute
force over every way of splitting the budget among the rows."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from opttree.step.tree import DraftTree, allocate


def random_tree(g: torch.Generator, size: int, first_id: int) -> DraftTree:
    """Nodes in parent-before-child order with path log-probabilities (they fall along a path); token ids
    unique across the batch, so a kept node is known by its token."""
    parents, depths, scores = [], [], []
    for i in range(size):
        parent = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
        step = math.log(float(torch.empty(1).uniform_(0.05, 1.0, generator=g)))
        parents.append(parent)
        depths.append(1 if parent < 0 else depths[parent] + 1)
        scores.append(step + (scores[parent] if parent >= 0 else 0.0))
    long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return DraftTree(torch.arange(first_id, first_id + size), long(parents), long(depths), torch.tensor(scores),
                     torch.full((size,), -1))


def closed_subsets(tree: DraftTree) -> list[frozenset[int]]:
    """Every set of nodes that holds each member's parent: the trees a row could verify."""
    parents = tree.parents.tolist()
    found = []
    for mask in range(1 << len(parents)):
        members = {i for i in range(len(parents)) if mask >> i & 1}
        if all(parents[i] < 0 or parents[i] in members for i in members):
            found.append(frozenset(members))
    return found


def expected_accepted(tree: DraftTree, members) -> float:
    return sum(math.exp(float(tree.scores[i])) for i in members)


@pytest.mark.parametrize("seed", range(40))
def test_the_global_allocation_is_the_best_split_and_every_row_keeps_a_tree(seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [int(torch.randint(0, 6, (1,), generator=g)) for _ in range(int(torch.randint(1, 4, (1,), generator=g)))]
    firsts = [sum(sizes[:r]) for r in range(len(sizes))]
    trees = [random_tree(g, size, first) for size, first in zip(sizes, firsts)]
    options = [closed_subsets(tree) for tree in trees]
    for n in range(sum(sizes) + 2):
        best = max(sum(expected_accepted(t, s) for t, s in zip(trees, split))
                   for split in itertools.product(*options) if sum(map(len, split)) <= n)
        kept = allocate(trees, n)
        assert sum(map(len, kept)) == min(n, sum(sizes))
        total = 0.0
        for tree, new in zip(trees, kept):
            members = [int(t) - int(tree.tokens[0]) for t in new.tokens] if len(new) else []
            assert frozenset(members) in closed_subsets(tree) or not members  # a tree: parents kept
            # re-indexed consistently: each kept node's parent is the kept copy of its original parent
            for j, i in enumerate(members):
                parent = int(tree.parents[i])
                assert int(new.parents[j]) == (members.index(parent) if parent >= 0 else -1)
                assert int(new.depths[j]) == int(tree.depths[i])
            total += expected_accepted(tree, members)
        assert total == pytest.approx(best, rel=1e-9, abs=1e-12), (seed, n, sizes)


def test_sampled_trees_keep_their_own_nodes():
    """A tree of sampled nodes (draft_probs) was drawn for its own budget: it is not split."""
    g = torch.Generator().manual_seed(0)
    plain, sampled = random_tree(g, 4, 0), random_tree(g, 4, 4)
    sampled = DraftTree(sampled.tokens, sampled.parents, sampled.depths, sampled.scores, sampled.draft_slots,
                        torch.full((5, 8), 1 / 8))
    kept = allocate([plain, sampled], 1)
    assert len(kept[0]) == 1 and kept[1] is sampled


def best_split_sum(trees: list[DraftTree], n: int) -> float:
    return max(sum(expected_accepted(t, s) for t, s in zip(trees, split))
               for split in itertools.product(*[closed_subsets(t) for t in trees]) if sum(map(len, split)) <= n)


@pytest.mark.parametrize("seed", range(12))
def test_the_batch_budget_maximises_the_batchs_tokens_per_second_under_the_curve(seed):
    """BatchBudget's N: the argmax over N of (rows + best sum of p-hat with N nodes) / T(rows + N), by brute
    force over every split, for curves flat, rising, and past their measured end."""
    from opttree.step.policies.batch import BatchBudget

    g = torch.Generator().manual_seed(100 + seed)
    sizes = [int(torch.randint(1, 5, (1,), generator=g)) for _ in range(int(torch.randint(2, 4, (1,), generator=g)))]
    trees = [random_tree(g, size, sum(sizes[:r])) for r, size in enumerate(sizes)]
    rows, total = len(trees), sum(sizes)
    for curve in ([1.0] * 20, [1.0 + 0.2 * k for k in range(20)], [1.0 + 0.05 * k * k for k in range(20)], [1.0, 1.3]):
        budget = BatchBudget(curve=curve)
        values = [(rows + best_split_sum(trees, n)) / float(budget.seconds(torch.tensor([rows + n]))[0])
                  for n in range(total + 1)]
        chosen = budget.best_total(trees)
        assert values[chosen] == pytest.approx(max(values), rel=1e-9), (curve, values, chosen)
        kept = budget(trees)
        assert sum(map(len, kept)) == chosen


def test_the_batch_budget_shrinks_toward_plain_decoding_when_tokens_cost_in_proportion():
    """A flat curve (tokens cost nothing: a GPU far from its bend) verifies every candidate; a curve where
    time grows in proportion to the tokens (a machine past its bend) verifies none: plain decoding."""
    from opttree.step.policies.batch import BatchBudget

    g = torch.Generator().manual_seed(7)
    trees = [random_tree(g, 5, 5 * r) for r in range(4)]
    assert BatchBudget(curve=[0.01] * 64).best_total(trees) == 20
    assert BatchBudget(curve=[0.01 * k for k in range(1, 65)]).best_total(trees) == 0
    assert [len(t) for t in BatchBudget(fixed=0)(trees)] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="one of them"):
        BatchBudget()
    with pytest.raises(ValueError, match="positive seconds"):
        BatchBudget(curve=[0.0, 1.0])
