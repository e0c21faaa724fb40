"""Block verification of sampled chains (`verify.block_rule`, `verify.accept_block`): enumerated on a small
vocabulary, the emitted tokens follow the target exactly and the expected accepted length is never below
token-level verification's, also when the chain's length depends on its own draws; two plausible slips in the rule
are caught by the same check."""

import itertools
import random

import pytest
import torch

from opttree.step.tree import DraftTree
from opttree.step.verify import accept_block, block_rule

VOCAB, LENGTH = 3, 3


def tables(seed: int):
    """Draft and target distributions per token path (a fixed random function of the path), float64."""
    g = torch.Generator().manual_seed(seed)
    paths = [p for n in range(LENGTH + 2) for p in itertools.product(range(VOCAB), repeat=n)]
    logits = {p: 1.5 * torch.randn(VOCAB, generator=g, dtype=torch.float64) for p in paths}
    noise = {p: torch.randn(VOCAB, generator=g, dtype=torch.float64) for p in paths}  # the draft: the target, blurred
    return {p: logits[p].softmax(-1) for p in paths}, {p: (logits[p] + noise[p]).softmax(-1) for p in paths}


def joint(p, tokens, start=()):
    prob, path = 1.0, tuple(start)
    for t in tokens:
        prob *= float(p[path][t])
        path += (t,)
    return prob


def cut_chains(q, go_on):
    """Chains of at least one draw from q, drafted on while `go_on(chain so far)` says so (at most LENGTH), with their
    probabilities under q: a length that is a stopping time of the draws."""
    out = []

    def grow(chain, prob):
        if len(chain) == LENGTH or (chain and not go_on(chain)):
            out.append((chain, prob))
            return
        for t in range(VOCAB):
            grow(chain + (t,), prob * float(q[chain][t]))

    grow((), 1.0)
    return out


def emitted_distribution(p, q, rule=block_rule, chains=None):
    """The exact distribution of the first LENGTH + 1 tokens when each step drafts a chain from q (every chain of
    LENGTH draws, or `chains`: (chain, probability) pairs), verifies it by `rule` and the target samples on past
    what a step emitted; also the expected accepted length."""
    out, accepted = {}, 0.0
    if chains is None:
        chains = [(chain, joint(q, chain)) for chain in itertools.product(range(VOCAB), repeat=LENGTH)]
    for chain, weight in chains:
        n = len(chain)
        prefixes = [chain[:i] for i in range(n + 1)]
        ends, rows = rule(torch.stack([p[c] for c in prefixes]), torch.stack([q[c] for c in prefixes[:-1]]),
                          torch.tensor(chain))
        deeper = 1.0  # the chance the block did not end below
        for length in range(n, -1, -1):
            here = deeper * (float(ends[length - 1]) if length else 1.0)
            deeper -= here
            if here == 0:
                continue
            accepted += weight * here * length
            bonus = rows[length] / rows[length].sum()
            for y in range(VOCAB):
                emitted = chain[:length] + (y,)
                for tail in itertools.product(range(VOCAB), repeat=LENGTH - length):
                    full = emitted + tail
                    out[full] = out.get(full, 0.0) + weight * here * float(bonus[y]) * joint(p, tail, emitted)
    return out, accepted


def token_level_accepted(p, q):
    """Expected accepted length when each token is accepted on its own with min(1, p / q)."""
    total = 0.0
    for chain in itertools.product(range(VOCAB), repeat=LENGTH):
        alive = 1.0
        for i in range(LENGTH):
            alive *= min(1.0, float(p[chain[:i]][chain[i]] / q[chain[:i]][chain[i]]))
            total += joint(q, chain) * alive
    return total


def error(p, distribution):
    """Total variation distance to the target's distribution of LENGTH + 1 tokens."""
    sequences = itertools.product(range(VOCAB), repeat=LENGTH + 1)
    return sum(abs(distribution.get(s, 0.0) - joint(p, s)) for s in sequences) / 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_verification_emits_the_target_distribution_and_accepts_more(seed):
    p, q = tables(seed)
    distribution, accepted = emitted_distribution(p, q)
    assert error(p, distribution) < 1e-9
    assert accepted >= token_level_accepted(p, q) - 1e-12
    assert accepted > token_level_accepted(p, q) + 0.01  # and on these tables strictly more


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_verification_stays_exact_when_the_length_depends_on_the_draws(seed):
    """A chain drafted on while the draft is confident in its last draw, or cut by any rule of the draws so far:
    block verification still emits the target's distribution exactly."""
    p, q = tables(seed)
    rng = random.Random(seed)
    confident = cut_chains(q, lambda chain: float(q[chain[:-1]][chain[-1]]) >= 0.4)
    assert {len(chain) for chain, _ in confident} == set(range(1, LENGTH + 1))  # the rule does cut chains here
    assert error(p, emitted_distribution(p, q, chains=confident)[0]) < 1e-9
    for _ in range(10):  # arbitrary rules: go on after a prefix of draws or not, at random
        go_on = {c: rng.random() < 0.5 for n in range(1, LENGTH) for c in itertools.product(range(VOCAB), repeat=n)}
        chains = cut_chains(q, lambda c: go_on[c])
        assert abs(sum(weight for _, weight in chains) - 1) < 1e-12
        assert error(p, emitted_distribution(p, q, chains=chains)[0]) < 1e-9


def test_the_check_catches_slips_in_the_rule():
    p, q = tables(1)

    def unweighted_residual(p_rows, q_rows, tokens):  # the bonus from max(p - q, 0), as token-level's
        ends, rows = block_rule(p_rows, q_rows, tokens)
        return ends, torch.cat([(p_rows[:-1] - q_rows).clamp(min=0), p_rows[-1:]])

    def ends_without_weight(p_rows, q_rows, tokens):  # h_i = r_i / (r_i + 1): the 1 - w_i term left out
        ends, rows = block_rule(p_rows, q_rows, tokens)
        mass = rows[1:-1].sum(dim=1)
        return torch.cat([mass / (mass + 1), ends[-1:]]), rows

    for slip in (unweighted_residual, ends_without_weight):
        assert error(p, emitted_distribution(p, q, slip)[0]) > 1e-4  # the rule itself: below 1e-9 (enumerated)


def test_accept_block_samples_the_rule():
    """accept_block's draws against the rule's probabilities: the accepted length and the bonus, 20k draws."""
    from helpers import chi_square_pvalue

    p, q = tables(3)
    chain = (1, 0, 2)
    prefixes = [chain[:i] for i in range(LENGTH + 1)]
    p_rows, q_rows = torch.stack([p[c] for c in prefixes]).float(), torch.stack([q[c] for c in prefixes[:-1]]).float()
    tree = DraftTree(torch.tensor(chain), torch.arange(LENGTH) - 1, torch.arange(1, LENGTH + 1), torch.zeros(LENGTH),
                     torch.full((LENGTH,), -1), torch.cat([q_rows, torch.zeros(1, VOCAB)]), chain=True)
    ends, rows = block_rule(p_rows.double(), q_rows.double(), tree.tokens)
    exact, deeper = {}, 1.0
    for length in range(LENGTH, -1, -1):
        here = deeper * (float(ends[length - 1]) if length else 1.0)
        deeper -= here
        for y in range(VOCAB):
            if here * float(rows[length][y]) > 0:
                exact[(length, y)] = here * float(rows[length][y] / rows[length].sum())
    g, draws, counts = torch.Generator().manual_seed(0), 20_000, {}
    for _ in range(draws):
        path, length, bonus = accept_block(tree, p_rows, g)
        counts[(int(length), int(bonus))] = counts.get((int(length), int(bonus)), 0) + 1
    assert path.tolist() == [0, 1, 2]
    assert chi_square_pvalue(counts, exact, draws) > 1e-3


def test_a_chain_cut_to_its_best_nodes_stays_a_chain_of_draws():
    """A batch's sizing cuts a row's tree to its best nodes (`top_nodes`): a chain's cut is a prefix of it, still
    verified as one block; an empty cut is no chain."""
    from opttree.step.tree import top_nodes

    p, q = tables(3)
    chain = (1, 0, 2)
    q_rows = torch.stack([q[chain[:i]] for i in range(LENGTH)]).float()
    keys = torch.tensor([-0.1, -0.5, -0.9])  # p-hat by draw rank: falling along the chain
    tree = DraftTree(torch.tensor(chain), torch.arange(LENGTH) - 1, torch.arange(1, LENGTH + 1), keys,
                     torch.full((LENGTH,), -1), torch.cat([q_rows, torch.zeros(1, VOCAB)]), keys, chain=True)
    cut = top_nodes(tree, 2, by=tree.keys)
    assert cut.chain and cut.tokens.tolist() == [1, 0] and cut.parents.tolist() == [-1, 0]
    assert torch.equal(cut.draft_probs, tree.draft_probs[:3])
    assert not top_nodes(tree, 0, by=tree.keys).chain


def verified_three_nodes(chain: bool):
    """A tiny model's cache of a 7-token prompt's first 6 and 3 nodes under its last one, verified as a chain of draws
    (`chain`) or as a tree of the same shape: (model, cache, root, tree, logits (4, V))."""
    from helpers import tiny_model

    from opttree.step.cache import cache_argument, new_cache
    from opttree.step.verify import verify_trees

    model = tiny_model("llama", seed=3)
    prompt = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    tree = DraftTree(torch.tensor([11, 5, 40]), torch.arange(3) - 1, torch.arange(1, 4), torch.zeros(3),
                     torch.full((3,), -1), torch.full((4, 96), 1 / 96), chain=chain)
    cache = new_cache(model)
    with torch.inference_mode():
        model(input_ids=prompt[:, :-1], **{cache_argument(model): cache})
        logits = verify_trees(model, cache, [prompt[0, -1]], [tree], [6])[0]
    return model, cache, prompt[0, -1], tree, logits


def test_a_chain_verifies_under_the_causal_mask_its_tree_mask_is():
    """A chain of draws skips the tree mask (`verify_trees`: the causal mask after the prefix, two ops): the same
    logits and cache as the same nodes verified as a tree."""
    (_, chain_cache, _, _, chain_logits), (_, tree_cache, _, _, tree_logits) = map(verified_three_nodes, (True, False))
    assert torch.equal(chain_logits, tree_logits)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(chain_cache.layers, tree_cache.layers, strict=True))


@pytest.mark.parametrize("accepted", [0, 2, 3])
def test_a_chain_commits_its_accepted_nodes_where_they_are(accepted, monkeypatch):
    """`TreeVerifier.commit` keeps a chain of draws' accepted nodes (its first A) by truncating the cache after them,
    no copy: the same keys and values as the same path committed from a tree, which gathers them."""
    from opttree.step.verify import TreeVerifier

    caches, copies = [], []
    for chain in (True, False):
        model, cache, root, tree, _ = verified_three_nodes(chain)
        gathers, original = [], torch.Tensor.index_select
        monkeypatch.setattr(torch.Tensor, "index_select",
                            lambda self, *a, **k: gathers.append(1) or original(self, *a, **k))
        with torch.inference_mode():
            TreeVerifier(model).commit(cache, [root], [tree], [torch.arange(accepted)], [6])
        monkeypatch.setattr(torch.Tensor, "index_select", original)
        caches.append(cache)
        copies.append(len(gathers))
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert a.keys.shape[2] == 7 + accepted and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert copies[0] == 0 and copies[1] == (1 if accepted else 0)  # a tree's path: one gather for every layer
