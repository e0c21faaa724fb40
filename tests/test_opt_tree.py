"""OPT-Tree against brute force: optimal sum of p-hat, connected, min(n, available) nodes, no wasted forward."""

import itertools

import pytest
import torch
from helpers import ScriptedDrafter, hf_greedy, path_of, tiny_model

import opttree
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


class ListedDrafter(ScriptedDrafter):
    """The same drafter answering with its listed best children (`top_children`), at most `listed` a node
    (the rest padded with -inf, as a trie's short rows are)."""

    top_children = True

    def __init__(self, vocab: int, seed: int, listed: int | None = None):
        super().__init__(vocab, seed=seed)
        self.listed = listed or vocab

    def root_top(self, committed, k):
        tokens, logq = self._top(self.root(committed)[None], k)
        return tokens[0], logq[0]

    def expand_top(self, tokens, parent_slots, k):
        return self._top(self.expand(tokens, parent_slots), k)

    def _top(self, rows, k):
        top = rows.topk(min(k, self.vocab), dim=1)
        short = torch.arange(top.values.shape[1]) >= self.listed
        return top.indices, top.values.masked_fill(short, float("-inf"))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n,vocab,depth,delta", [(3, 4, 3, 0.0), (10, 3, 4, 0.0), (16, 5, 5, 0.05), (50, 3, 3, 0.0)])
def test_listed_children_give_the_tree_of_the_full_rows(seed, n, vocab, depth, delta):
    policy = make_policy(SpecConfig(tree="opt", budget=n, delta=delta, max_depth=depth))
    full, listed = ScriptedDrafter(vocab, seed=seed), ListedDrafter(vocab, seed=seed)
    a = policy.build(full, torch.tensor([0]), depth_limit=100)
    b = policy.build(listed, torch.tensor([0]), depth_limit=100)
    for name in ("tokens", "parents", "depths", "draft_slots"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.allclose(a.scores, b.scores)
    assert full.expand_calls == listed.expand_calls  # the same draft layers


@pytest.mark.parametrize("seed", range(4))
def test_children_a_drafter_does_not_list_are_never_drafted(seed):
    """A node lists 2 children (a trie's short rows): the tree is the best of those, no padding node in it."""
    vocab, depth = 5, 3
    drafter = ListedDrafter(vocab, seed=seed, listed=2)
    tree = make_policy(SpecConfig(tree="opt", budget=20, delta=0.0, max_depth=depth)).build(drafter, torch.tensor([0]), 100)
    assert len(tree) == 2 + 4 + 8  # every listed node (20 wanted), none of the padding
    assert bool(torch.isfinite(tree.scores).all())
    for i in range(len(tree)):
        path = path_of(tree, i)
        assert path[-1] in drafter.logq(path[:-1]).topk(2).indices.tolist()


def test_a_users_listed_children_are_exact_and_checked():
    target, prompt = tiny_model("llama"), torch.tensor([[1, 5, 9, 2]])
    out = opttree.generate(target, prompt, ListedDrafter(96, seed=0, listed=3), max_new_tokens=12, budget=6,
                           eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 12, eos_token_id=[]))
    bad = ListedDrafter(96, seed=0)
    bad._top = lambda rows, k: (torch.full((rows.shape[0], 2), 500), torch.zeros(rows.shape[0], 2))
    with pytest.raises(ValueError, match=r"ListedDrafter.root_top\(\) returned a token outside the vocabulary"):
        opttree.generate(target, prompt, bad, max_new_tokens=4, budget=4)
