"""OPT-Tree against brute force: optimal sum of p-hat, connected, min(n, available) nodes, no wasted forward."""

import itertools

import pytest
import torch
from helpers import ScriptedDrafter, path_of

from opttree.settings.config import SpecConfig
from opttree.step.policies import make_policy


def best_subtree_value(drafter: ScriptedDrafter, n: int, max_depth: int) -> float:
    """Brute force over the whole candidate tree (every path up to max_depth): the largest sum of
    p-hat of a connected n-node subtree hanging from the root (tree-knapsack dynamic programme)."""

    def table(path, p_hat):  # best[k] = best value of k nodes in the subtree of `path`, path included
        best = [0.0, p_hat]
        if len(path) < max_depth:
            q = drafter.logq(path).exp().tolist()
            for token in range(drafter.vocab):
                child = table(path + (token,), p_hat * q[token])
                merged = best[:]
                for a, b in itertools.product(range(1, len(best)), range(1, len(child))):
                    if a + b <= n:
                        if a + b >= len(merged):
                            merged += [float("-inf")] * (a + b + 1 - len(merged))
                        merged[a + b] = max(merged[a + b], best[a] + child[b])
                best = merged
        return best

    root = [0.0]
    q = drafter.logq(()).exp().tolist()
    for token in range(drafter.vocab):  # the root itself is not counted
        child = table((token,), q[token])
        merged = root[:]
        for a, b in itertools.product(range(len(root)), range(1, len(child))):
            if a + b <= n:
                if a + b >= len(merged):
                    merged += [float("-inf")] * (a + b + 1 - len(merged))
                merged[a + b] = max(merged[a + b], root[a] + child[b])
        root = merged
    return root[min(n, len(root) - 1)]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n,vocab,depth", [(1, 4, 3), (3, 4, 3), (6, 3, 3), (10, 3, 4), (50, 3, 3)])
def test_opt_tree_is_the_brute_force_optimum(seed, n, vocab, depth):
    drafter = ScriptedDrafter(vocab, seed=seed)
    policy = make_policy(SpecConfig(tree="opt", budget=n, delta=0.0, max_depth=depth))
    tree = policy.build(drafter, torch.tensor([0]), depth_limit=100)
    available = sum(vocab**d for d in range(1, depth + 1))
    assert len(tree) == min(n, available)
    # connected, parents before children, depths consistent
    assert bool((tree.parents < torch.arange(len(tree))).all())
    has_parent = tree.parents >= 0
    assert torch.equal(tree.depths[has_parent], tree.depths[tree.parents[has_parent]] + 1)
    assert bool((tree.depths[~has_parent] == 1).all())
    # scores are the path log-probabilities under the drafter
    for i in range(len(tree)):
        path = path_of(tree, i)
        expected = sum(float(drafter.logq(path[:k])[path[k]]) for k in range(len(path)))
        assert abs(float(tree.scores[i]) - expected) < 1e-4
    assert len({path_of(tree, i) for i in range(len(tree))}) == len(tree)  # no duplicate nodes
    optimum = best_subtree_value(drafter, n, depth)
    assert abs(float(tree.scores.exp().sum()) - optimum) < 1e-5


@pytest.mark.parametrize("delta,limit", [(0.5, 100), (0.0, 100), (0.0, 3), (0.2, 2)])
def test_no_wasted_draft_forward(delta, limit):
    """The drafter never runs the deepest candidate layer, nor a layer none of whose nodes is kept."""
    for seed in range(5):
        drafter = ScriptedDrafter(5, seed=seed, sharpness=0.5)
        tree = make_policy(SpecConfig(tree="opt", budget=8, delta=delta, max_depth=6)).build(drafter, torch.tensor([0]), limit)
        expanded_depth = max((len(p) for p in drafter.paths), default=0)
        assert expanded_depth <= tree.max_depth and tree.max_depth <= min(6, limit)
        assert len(drafter.expand_calls) == expanded_depth  # one forward per layer


def test_delta_stops_deepening():
    def depth(delta, seed):
        drafter = ScriptedDrafter(5, seed=seed, sharpness=3.0)
        return make_policy(SpecConfig(tree="opt", budget=8, delta=delta, max_depth=8)).build(drafter, torch.tensor([0]), 100).max_depth

    pairs = [(depth(0.6, seed), depth(0.0, seed)) for seed in range(6)]
    assert all(shallow <= deep for shallow, deep in pairs)
    assert any(shallow < deep for shallow, deep in pairs)


def test_ties_prefer_the_shallower_node():
    class Certain(ScriptedDrafter):
        def logq(self, path):  # the first token is certain everywhere: children tie with their parents
            out = torch.full((self.vocab,), -1e9)
            out[0] = 0.0
            return torch.log_softmax(out, dim=-1)

    tree = make_policy(SpecConfig(tree="opt", budget=4, delta=0.0, max_depth=8)).build(Certain(3), torch.tensor([0]), 100)
    assert len(tree) == 4
    assert bool((tree.parents < torch.arange(4)).all())
    assert tree.tokens[:4].tolist()[0] == 0 and tree.max_depth == 4


def test_the_delta_stop_decided_on_the_device_gives_the_same_tree(monkeypatch):
    """Drafting every layer and masking those past the stop (nothing read back) builds the tree the
    host-side stop builds, layer by layer, at every delta; and the mask matters (without it, deeper
    nodes would get in)."""
    from opttree.step.policies.opt import OptTree

    mattered = 0
    for seed, delta, n, max_depth in itertools.product(range(25), (0.02, 0.1, 0.3), (5, 12), (1, 3, 6)):
        policy = make_policy(SpecConfig(tree="opt", budget=n, delta=delta, max_depth=max_depth))
        trees, calls = {}, {}
        for on_device in (False, True):
            monkeypatch.setattr(OptTree, "stop_on_device", on_device)
            drafter = ScriptedDrafter(4, seed=seed, sharpness=3.0)
            trees[on_device] = policy.build(drafter, torch.tensor([1, 2]), max_depth)
            calls[on_device] = len(drafter.expand_calls)
        host, device = trees[False], trees[True]
        for field in ("tokens", "parents", "depths", "scores"):
            assert torch.equal(getattr(host, field), getattr(device, field)), (field, seed, n, max_depth, delta)
        assert calls[True] == max_depth - 1 and calls[False] <= calls[True]
        policy.delta = float("-inf")  # no stop at all
        unmasked = policy.build(ScriptedDrafter(4, seed=seed, sharpness=3.0), torch.tensor([1, 2]), max_depth)
        mattered += not torch.equal(unmasked.depths, host.depths)
    assert mattered >= 10
