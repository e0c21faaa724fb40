"""Trees whose children are sampled from the draft (OPT-Tree and EAGLE-2 at temperature > 0, alone or
with deterministic candidates under the same nodes) emit exactly the target's distribution.

Brute force on a 4-token vocabulary: draft and target are fixed random distributions per token path
(a table, no model, so a draw costs about a millisecond); the policy builds a tree, `accept_path`
verifies it as the engine does, and the first two emitted tokens (a, b) are counted against the
enumerated p(a) p(b | a). The same draws with a planted bug (1.5 % of the steps emit token 0 first)
must fail the check: the number of draws is what lets it see a bias that small.
"""

import multiprocessing
import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import pytest
import torch
from helpers import chi_square_pvalue
from transformers.generation import logits_process as lp

from opttree.settings.config import SpecConfig
from opttree.settings.declared import Declared
from opttree.step.drafters.sources import MergedPolicy, Sources
from opttree.step.policies import make_policy
from opttree.step.policies.dyspec import DySpec
from opttree.step.tree import DraftTree, node_paths
from opttree.step.verify import accept_path

VOCAB = 4
BIAS = 0.015


def path_table(seed: int, sharpness: float):
    """path -> (V,) log-probabilities, a fixed random function of the token path (cached)."""
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def logp(path: tuple[int, ...]) -> torch.Tensor:
        if path not in cache:
            g = torch.Generator().manual_seed(hash((seed,) + path) % 2**31)
            cache[path] = torch.log_softmax(sharpness * torch.randn(VOCAB, generator=g), dim=-1)
        return cache[path]

    return logp


class TableDrafter(Declared):
    """A Drafter over a path table: root / expand answer the table's rows for the nodes' paths."""

    def __init__(self, logq):
        self.logq, self.paths = logq, []

    def root(self, committed):
        self.paths = []
        return self.logq(())

    def expand(self, tokens, parent_slots):
        paths = [(self.paths[p] if p >= 0 else ()) + (t,) for t, p in zip(tokens.tolist(), parent_slots.tolist())]
        self.paths += paths
        return torch.stack([self.logq(path) for path in paths])


def warped(logp: torch.Tensor, config: SpecConfig) -> torch.Tensor:
    """(V,) the distribution plain sampling draws from: transformers' warpers for the temperature, top-k, min-p
    and typical (no others here), in generate's order."""
    warpers = [lp.TemperatureLogitsWarper(config.temperature)]
    warpers += [lp.TopKLogitsWarper(config.top_k)] if config.top_k else []
    warpers += [lp.MinPLogitsWarper(config.min_p)] if config.min_p else []
    warpers += [lp.TypicalLogitsWarper(config.typical_p)] if config.typical_p < 1 else []
    scores = logp[None]  # (1, V)
    for warper in warpers:
        scores = warper(None, scores)
    return scores[0].softmax(-1)


class FixedTrie(Declared):
    """A candidate source that proposes the same trie every step: deterministic candidates, three of
    them likely enough to join a sampled tree (under the root: tokens the draft often draws too), one not."""

    PATHS = {(2,): 0.5, (2, 1): 0.4, (0,): 0.3, (1,): 0.1}

    def propose(self, committed, max_nodes, max_depth):
        paths = list(self.PATHS)
        return DraftTree(torch.tensor([p[-1] for p in paths]), torch.tensor([paths.index(p[:-1]) if len(p) > 1 else -1
                                                                             for p in paths]),
                         torch.tensor([len(p) for p in paths]), torch.tensor(list(self.PATHS.values())).log(),
                         torch.full((len(paths),), -1))


def draw_first_two(config: SpecConfig, draws: int, mixed: bool = False, seed: int = 0, on_device: bool = False
                   ) -> tuple[Counter, Counter, Counter]:
    """Counts of the first two emitted tokens over `draws` steps, the same with the planted bias, and what
    the trees looked like. `mixed`: `FixedTrie`'s deterministic candidates join the sampled tree, as a
    combination of sources (`model+lookup`) builds it. `on_device`: DySpec grows in fixed shapes."""
    torch.set_num_threads(1)
    DySpec.grow_on_device = on_device
    target, draft = path_table(1, 1.2), path_table(2, 1.5)
    policy, drafter = make_policy(replace(config, seed=seed)), TableDrafter(draft)
    if mixed:
        policy = MergedPolicy(policy, config.budget, config.max_depth, prune=False)
        drafter = Sources(drafter, [FixedTrie()])
    g, bug = torch.Generator().manual_seed(2 * seed), torch.Generator().manual_seed(2 * seed + 1)
    planted = int(warped(target(()), config).masked_fill(warped(target(()), config) == 0, 2).argmin())  # rarest first token
    counts, biased, seen = Counter(), Counter(), Counter()
    committed = torch.tensor([0])
    with torch.inference_mode():
        for _ in range(draws):
            tree = policy.build(drafter, committed, config.max_depth)
            paths = node_paths(tree)
            logits = torch.stack([target(())] + [target(p) for p in paths])  # (N + 1, V) at [root] + nodes
            path, length, bonus = accept_path(tree, logits, config, g)
            emitted = [paths[i][-1] for i in path[: int(length)].tolist()] + [int(bonus)]
            if len(emitted) == 1:  # the next step samples the second token: plain sampling stands in for it
                emitted.append(int(torch.multinomial(warped(target((emitted[0],)), config), 1, generator=g)))
            cell = tuple(emitted[:2])
            counts[cell] += 1
            biased[(planted, cell[1]) if float(torch.rand((), generator=bug)) < BIAS else cell] += 1
            seen["accepted"] += int(length) > 0
            seen["deep"] += tree.max_depth >= 2
            # a root with fewer children (its draws held fewer distinct tokens) may leave room for another layer
            seen["full depth"] += tree.max_depth == config.max_depth and int((tree.parents == -1).sum()) == config.budget
            seen["branching"] += bool(torch.bincount(tree.parents + 1).max() >= 2)
            if tree.proposed is not None:  # mixed: a node of both kinds, and deterministic nodes accepted
                seen["both"] += bool((tree.proposed & torch.isfinite(tree.keys)).any())
                seen["proposed accepted"] += bool(tree.proposed[path[: int(length)]].any())
    return counts, biased, seen


def exact_first_two(config: SpecConfig) -> dict[tuple[int, int], float]:
    target = path_table(1, 1.2)
    first = warped(target(()), config)
    exact = {(a, b): float(first[a] * warped(target((a,)), config)[b]) for a in range(VOCAB) for b in range(VOCAB)}
    return {cell: p for cell, p in exact.items() if p > 0}


def check(config: SpecConfig, draws: int, mixed: bool = False, bias: bool = True, chain: bool = False,
          on_device: bool = False) -> None:
    """`draws` in two halves with seeds of their own: in two processes (the machine's two cores), or one after
    the other in this one under pytest-xdist, whose workers keep the cores busy already."""
    halves = [config] * 2, [draws // 2] * 2, [mixed] * 2, [0, 1], [on_device] * 2
    if os.environ.get("PYTEST_XDIST_WORKER"):
        try:
            parts = list(map(draw_first_two, *halves))
        finally:
            DySpec.grow_on_device = False
    else:
        with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = list(pool.map(draw_first_two, *halves))
    counts, biased, seen = (sum((part[i] for part in parts), Counter()) for i in range(3))
    exact = exact_first_two(config)
    # the trees branch (chains: never) and go deeper than one layer, and verification both accepts and rejects
    assert seen["deep"] > draws // 10 and (seen["branching"] == 0 if chain else seen["branching"] > draws // 10), seen
    assert draws // 20 < seen["accepted"] < draws - draws // 20, seen
    if config.delta > 0 and config.tree == "opt":  # the stop cuts the trees short (those with a full first layer)
        assert seen["full depth"] == 0, seen
    if mixed:
        assert seen["both"] > draws // 50 and seen["proposed accepted"] > draws // 10, seen
    assert chi_square_pvalue(counts, exact, draws) > 1e-3
    if bias:
        assert chi_square_pvalue(biased, exact, draws) < 1e-4  # the check sees a 1.5 % bias


def test_opt_tree_with_sampled_children_emits_the_target_distribution():
    """OPT-Tree with sampled children: the budget's best p-hat by draw rank, 1e5 draws."""
    check(SpecConfig(tree="opt", budget=4, delta=0.0, max_depth=2, temperature=1.0, children="sampled"), 100_000)


@pytest.mark.parametrize("options,draws", [
    (dict(tree="eagle2", budget=4, max_depth=2), 20_000),  # k = 2: the 2 best of each layer expanded
    # warped (q's support < V), a calibrated acceptance vector that makes second children pay, and the delta stop
    (dict(tree="opt", budget=3, delta=0.2, max_depth=3, temperature=0.7, top_k=3, acceptance=(0.5, 0.3, 0.1)), 12_000),
    # transformers' own warpers (min-p, typical) on both distributions, p and the q children are drawn from
    (dict(tree="opt", budget=4, delta=0.0, max_depth=2, temperature=1.2, min_p=0.1, typical_p=0.9), 8_000),
])
def test_other_sampled_trees_emit_the_target_distribution(options, draws):
    check(SpecConfig(**{"temperature": 1.0, **options, "children": "sampled"}), draws, bias=draws >= 20_000)


def test_dyspec_grown_on_the_device_emits_the_target_distribution():
    """DySpec's growth in fixed shapes (`DySpec.grow_on_device`): the same valid nodes as on the host, the tree
    filled to the budget with slots that were never drawn (never tried), 20k draws."""
    check(SpecConfig(tree="dyspec", budget=4, delta=0.4, max_depth=2, temperature=1.0), 20_000, on_device=True)


def test_sampled_chains_emit_the_target_distribution():
    """Speculative sampling's chain of draws, verified as one block (`verify.accept_block`), 20k draws."""
    check(SpecConfig(tree="chain", budget=3, max_depth=3, temperature=1.0), 20_000, chain=True)


@pytest.mark.parametrize("where", ["host", "device"])
def test_mixed_trees_emit_the_target_distribution(where, monkeypatch):
    """Sampled children and deterministic candidates under the same nodes, verified by one rule, walked on the
    host and decided on the device (`verify.rejection_on_device`; the drawing processes inherit the setting)."""
    monkeypatch.setenv("OPTTREE_REJECTION", where)
    check(SpecConfig(tree="opt", budget=5, delta=0.0, max_depth=2, temperature=1.0, children="sampled"), 20_000,
          mixed=True)  # 20k draws: the planted bias is caught here too


def rank_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's path of draw ranks (a node's rank = how many earlier nodes share its parent)."""
    parents, paths = tree.parents.tolist(), []
    for i, parent in enumerate(parents):
        rank = parents[:i].count(parent)
        paths.append((paths[parent] if parent >= 0 else ()) + (rank,))
    return paths


@pytest.mark.parametrize("tree,budget,depth", [("opt", 10, 4), ("opt", 6, 6), ("eagle2", 9, 3)])
def test_sampled_trees_take_the_best_nodes_by_draw_rank(tree, budget, depth, monkeypatch):
    """Sampled children's p-hat is the product of the acceptance of their draw ranks, so OPT-Tree (no stop) builds
    the tree of most expected accepted tokens under that model, Sequoia's optimum; EAGLE-2 at most that. The tree
    never looks at the drawn tokens: every step has the same shape (with draws enough that every node gets all
    the children asked for), and siblings stay in draw order."""
    from opttree.step import sampling
    from opttree.step.policies.sequoia import optimal_tree, tree_value

    monkeypatch.setattr(sampling, "DRAWS_PER_CHILD", 200)
    acc = (0.6, 0.25, 0.1, 0.04)
    config = SpecConfig(tree=tree, budget=budget, delta=0.0, max_depth=depth, temperature=1.0, children="sampled",
                        acceptance=acc)
    policy, drafter = make_policy(config), TableDrafter(path_table(2, 1.5))
    shapes = set()
    for step in range(20):
        built = policy.build(drafter, torch.tensor([step]), depth)
        paths = rank_paths(built)
        shapes.add(tuple(sorted(paths)))
        assert torch.allclose(built.scores.exp(), torch.tensor([tree_value(acc, [p]) for p in paths]))
        assert torch.equal(built.keys, built.scores)
    assert len(shapes) == 1
    best = tree_value(acc, optimal_tree(acc, budget, depth))
    value = tree_value(acc, list(shapes.pop()))
    assert value == pytest.approx(best, rel=1e-6) if tree == "opt" else value <= best + 1e-9


def _layer_rule(log_acc: list[float], n: int, delta: float, max_depth: int) -> list[float]:
    """Brute force of OPT-Tree over draw-rank p-hat: every rank path up to max_depth enumerated; the depth is the
    first whose n best nodes gain no more than delta over the depth before; the tree's values, best first."""
    import itertools
    import math

    def best(depth):
        values = [sum(log_acc[r] for r in path) for d in range(1, depth + 1)
                  for path in itertools.product(range(len(log_acc)), repeat=d)]
        return sorted(values, reverse=True)[:n]

    e_prev = 0.0
    for depth in range(1, max_depth + 1):
        values = best(depth)
        e_depth = sum(math.exp(v) for v in values)
        if depth == max_depth or e_depth - e_prev <= delta:
            return values
        e_prev = e_depth


@pytest.mark.parametrize("acc", [(0.66, 0.1, 0.06, 0.04), (0.9, 0.05), (0.3, 0.25, 0.2, 0.1, 0.05)])
@pytest.mark.parametrize("n,delta,max_depth", [(1, 0.0, 3), (4, 0.0, 3), (8, 0.6, 4), (8, 0.25, 4), (12, 0.4, 3),
                                               (6, float("-inf"), 2)])
def test_the_sampled_tree_is_opt_trees_layer_rule_over_draw_ranks(acc, n, delta, max_depth):
    """`drawn_paths` (the tree of sampled children, made once on the host) is the layer-by-layer rule's tree:
    the n best draw-rank paths, as deep as the delta stop lets it go; a tree whose siblings take ranks 0, 1, ..."""
    from opttree.step.policies.opt import drawn_paths
    from opttree.step.policies.shapes import rank_log_acceptance

    log_acc = rank_log_acceptance(acc, n)
    nodes = drawn_paths(log_acc, n, delta, max_depth)
    assert sorted((v for _, v in nodes), reverse=True) == pytest.approx(_layer_rule(log_acc, n, delta, max_depth))
    paths = [path for path, _ in nodes]
    assert all(len(p) == 1 or p[:-1] in paths for p in paths)  # a tree
    assert all(p[-1] == 0 or p[:-1] + (p[-1] - 1,) in paths for p in paths)  # siblings take the first ranks
    assert [len(p) for p in paths] == sorted(len(p) for p in paths)  # by depth


def test_a_draw_a_peaked_row_could_not_make_leaves_its_node_and_subtree_undrawn():
    """The root's distribution puts all its mass on token 1: its first child is 1, the later ones cannot be
    drawn. They stay in the tree with key -inf (never tried by rejection sampling), and so do their subtrees;
    the tree carries the distribution each node's children were drawn from, zeros where none were."""
    logq = {(): torch.tensor([0.0, 1.0, 0.0, 0.0]).log()}
    drafter = TableDrafter(lambda path: logq.get(path, torch.full((VOCAB,), 0.25).log()))
    policy = make_policy(SpecConfig(tree="opt", budget=6, delta=0.0, max_depth=2, temperature=1.0,
                                    acceptance=(0.5, 0.3, 0.1)))
    tree = policy.build(drafter, torch.tensor([0]), 2)
    paths = rank_paths(tree)
    drawn = tree.drawn.tolist()
    assert tree.tokens[paths.index((0,))] == 1 and drawn[paths.index((0,))]
    assert [drawn[i] for i, p in enumerate(paths) if p[0] > 0] == [False] * sum(p[0] > 0 for p in paths) != []
    assert torch.equal(tree.draft_probs[0], logq[()].exp())
    for i, path in enumerate(paths):
        expanded = any(p[:-1] == path for p in paths)
        assert tree.draft_probs[i + 1].sum() == pytest.approx(1.0 if expanded else 0.0)
