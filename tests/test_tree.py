"""The tree's derived tensors against brute force, and tree attention against causal attention."""

import pytest
import torch
from helpers import tiny_model

from opttree.step.cache import cache_argument, new_cache
from opttree.step.tree import (
    SQUARING_MAX_NODES,
    DraftTree,
    ancestor_mask,
    block_on_host,
    leaf_paths,
    position_ids,
    tree_attention_mask,
    tree_block,
)
from opttree.step.verify import verify_tree


def random_parents(n: int, seed: int) -> torch.Tensor:
    """A random tree with nodes stored parents-before-children."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1]
    for i in range(1, n):
        parents.append(int(torch.randint(-1, i, (1,), generator=g)))
    return torch.tensor(parents[:n])


def branch(parents: torch.Tensor, node: int) -> list[int]:
    """Brute force: the node's root->node path."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


def depths_of(parents):
    return torch.tensor([len(branch(parents, i)) for i in range(len(parents))])


def chain_with_twigs(n: int) -> torch.Tensor:
    """A path of n // 2 + 1 levels with a one-node twig on every other node: depth about n / 2."""
    parents, spine = [-1], 0
    while len(parents) < n:
        parents.append(spine)
        spine = len(parents) - 1
        if len(parents) < n:
            parents.append(spine)  # a twig
    return torch.tensor(parents)


@pytest.mark.parametrize("parents", [random_parents(25, seed) for seed in range(6)]
                         + [torch.tensor([-1]), torch.tensor([-1, 0]), torch.tensor([-1, -1]),
                            torch.arange(-1, 36), chain_with_twigs(33), chain_with_twigs(64),
                            random_parents(200, 7), chain_with_twigs(150)])  # past SQUARING_MAX_NODES too
def test_ancestor_mask_matches_brute_force(parents):
    n = parents.shape[0]
    mask = ancestor_mask(parents)
    for i in range(n):
        expected = torch.zeros(n, dtype=torch.bool)
        expected[branch(parents, i)] = True
        assert torch.equal(mask[i], expected)


@pytest.mark.parametrize("parents", [random_parents(25, seed) for seed in range(6)]
                         + [torch.tensor([-1]), torch.tensor([-1, -1]), torch.arange(-1, 36), chain_with_twigs(33),
                            chain_with_twigs(64), random_parents(200, 7), torch.empty(0, dtype=torch.long)])
def test_tree_block_on_the_device_and_the_host_and_with_a_depth_bound(parents):
    """`tree_block` (the verify mask's tree part over [root] + nodes) equals the brute-force ancestor sets with the
    root column added, made on the host (`block_on_host`) or on the device, without a depth bound or with the tree's
    depth (fewer rounds); by squaring, a bound below the depth misses ancestors (the bound is what sets the rounds)."""
    n = parents.shape[0]
    expected = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    expected[:, 0] = True
    for i in range(n):
        expected[i + 1, [j + 1 for j in branch(parents, i)]] = True
    depth = int(depths_of(parents).max()) if n else 0
    assert torch.equal(tree_block(parents), expected)
    assert torch.equal(tree_block(parents, depth), expected)
    assert torch.equal(torch.from_numpy(block_on_host(tuple(parents.tolist()))), expected)
    if depth > 2 and n <= SQUARING_MAX_NODES:
        assert not torch.equal(tree_block(parents, 2), expected)


@pytest.mark.parametrize("seed", range(4))
def test_tree_attention_row_is_causal_attention_over_the_branch(seed):
    parents, prefix = random_parents(20, seed), 7
    mask = tree_attention_mask(parents, prefix)
    assert mask.shape == (21, prefix + 21)
    assert torch.equal(mask[0], torch.cat([torch.ones(prefix + 1), torch.zeros(20)]).bool())
    for i in range(20):
        expected = torch.zeros(prefix + 21, dtype=torch.bool)
        expected[: prefix + 1] = True  # committed prefix + root
        expected[[prefix + 1 + j for j in branch(parents, i)]] = True
        assert torch.equal(mask[i + 1], expected)


def test_positions_and_leaf_paths():
    parents = random_parents(30, 11)
    depths = depths_of(parents)
    assert torch.equal(position_ids(depths, 5), torch.cat([torch.tensor([5]), 5 + depths]))
    paths = leaf_paths(parents, depths)
    leaves = set(range(30)) - set(parents.tolist())
    assert paths.shape == (len(leaves), int(depths.max()))
    got = {tuple(p for p in row.tolist() if p >= 0) for row in paths}
    assert got == {tuple(branch(parents, leaf)) for leaf in leaves}


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_forward_equals_causal_forward_per_branch(arch, attn):
    model = tiny_model(arch, attn=attn, seed=3)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 96, (9,), generator=g)
    parents = random_parents(12, 5)
    depths = depths_of(parents)
    tree = DraftTree(torch.randint(0, 96, (12,), generator=g), parents, depths, torch.zeros(12), -torch.ones(12, dtype=torch.long))
    with torch.inference_mode():
        cache = new_cache()
        model(input_ids=prompt[None, :-1], **{cache_argument(model): cache})
        logits = verify_tree(model, cache, prompt[-1], tree, prompt.shape[0] - 1)  # (13, V)
        full = model(input_ids=prompt[None]).logits[0, -1]
        torch.testing.assert_close(logits[0], full, atol=1e-4, rtol=1e-4)
        for i in range(12):
            seq = torch.cat([prompt, tree.tokens[branch(parents, i)]])
            causal = model(input_ids=seq[None]).logits[0, -1]
            torch.testing.assert_close(logits[i + 1], causal, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_slot_tree_chain_kept_on_the_host_matches_written_slots(seed):
    """A drafter's slots: a chain added by `add_child_of_last` (kept on the host until a tree's slots follow) gives the
    same depths and ancestor sets as the same slots added as a tree, whatever follows, past the buffers' capacity."""
    from opttree.step.drafters.model import SlotTree

    gen = torch.Generator().manual_seed(seed)
    chain = int(torch.randint(0, 6, (1,), generator=gen))
    fast, slow = SlotTree(torch.device("cpu"), capacity=4), SlotTree(torch.device("cpu"), capacity=4)
    for _ in range(chain):
        got = fast.add_child_of_last()
        want = slow.add(torch.full((1,), slow.size - 1, dtype=torch.long))[0]
        assert got.tolist() == want.tolist()
    for _ in range(3):  # then tree layers, and a chain node under their last slot
        parents = torch.randint(-1, fast.size, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen)
        (d1, r1), (d2, r2) = fast.add(parents), slow.add(parents)
        assert d1.tolist() == d2.tolist() and r1.tolist() == r2.tolist()
        under_last = torch.full((1,), slow.size - 1, dtype=torch.long)
        assert fast.add_child_of_last().tolist() == slow.add(under_last)[0].tolist()
    assert fast.depths.tolist() == slow.depths.tolist()
    assert fast._reach[: fast.size, : fast.size].tolist() == slow._reach[: slow.size, : slow.size].tolist()
    # the ancestors are those of a tree: each slot reaches itself and its parent's set
    depths = fast.depths.tolist()
    reach = fast._reach[: fast.size, : fast.size]
    assert [int(row.sum()) for row in reach] == depths
