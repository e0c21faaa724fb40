"""The comparison tree policies (static, sequoia, eagle2, dyspec): lossless at temperature 0 and > 0,
the trees they build, Sequoia's dynamic programme against brute force, and recursive rejection
sampling against the exact distribution."""

import copy
from collections import Counter

import pytest
import torch
from helpers import ScriptedDrafter, chi_square_pvalue, exact_joint, hf_greedy, path_of, sample_counts, tiny_model

import opttree
from opttree.alignment import paired_logits
from opttree.settings.config import SpecConfig
from opttree.step.policies import make_policy, sequoia, shapes
from opttree.step.policies.eagle2 import top_k as eagle2_top_k
from opttree.step.policies.shapes import (DEFAULT_ACCEPTANCE, check_paths, kary_paths, rank_log_acceptance,
                                         ranked_paths)
from opttree.step.policies.static import DEFAULT_RANK_WEIGHTS, register_static_tree
from opttree.step.sampling import sample_without_replacement
from opttree.step.tree import ancestor_mask
from opttree.step.verify import accept_rejection_sampling

POLICIES = ["static", "static-k2", "sequoia", "eagle2", "dyspec"]


# ---------------------------------------------------------------- temperature 0: token identity


@pytest.fixture(scope="module", params=["llama", "gpt_neox"])
def pair(request):
    target = tiny_model(request.param, seed=1, layers=2, hidden=64)
    draft = tiny_model(request.param, seed=2, layers=1, hidden=32)
    return target, draft


def prompts(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (1, int(torch.randint(1, 20, (1,), generator=g))), generator=g) for _ in range(n)]


@pytest.mark.parametrize("tree", POLICIES)
@pytest.mark.parametrize("budget,delta,depth", [(1, 0.2, 8), (5, 0.5, 3), (24, 0.2, 6)])
def test_greedy_identity(pair, tree, budget, delta, depth):
    target, draft = pair
    for prompt in prompts(2, seed=budget):
        ref = hf_greedy(target, prompt, 24)
        out = opttree.generate(target, prompt, draft, tree=tree, budget=budget, delta=delta, max_depth=depth,
                               max_new_tokens=24, eos_token_id=[])
        assert torch.equal(out.sequences, ref), (tree, budget, prompt)


@pytest.mark.parametrize("tree", POLICIES)
def test_greedy_identity_with_the_target_as_its_own_draft(pair, tree):
    """Long accepted paths: cache compaction after deep acceptances, the depth limit near the end.
    The target is sharpened so that value-driven trees (dyspec) grow deep rather than wide."""
    target = copy.deepcopy(pair[0])
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(5.0)
    for prompt in prompts(2, seed=7):
        ref = hf_greedy(target, prompt, 30)
        out = opttree.generate(target, prompt, target, tree=tree, budget=12, delta=0.2, max_depth=6,
                               max_new_tokens=30, eos_token_id=[])
        assert torch.equal(out.sequences, ref)
        assert out.stats.mean_accepted_length > 2.0


# ---------------------------------------------------------------- temperature > 0: the exact distribution

VOCAB, STEPS, RUNS = 5, 3, 1500
FOLLOW_RUNS = 1000  # a check that sampling is exact; the checks that must catch a bias keep RUNS


@pytest.fixture(scope="module")
def small_pair():
    """A draft that resembles the target without matching it (a noisy, flatter copy): drafted nodes
    are accepted often enough to reach depth 2 and rejected often enough to use the residuals."""
    target = tiny_model("llama", vocab=VOCAB, hidden=32, layers=1, seed=11, init=0.6)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        head = draft.lm_head.weight  # (V, C)
        head.add_(0.6 * head.std() * torch.randn(head.shape, generator=torch.Generator().manual_seed(5)))
        head.mul_(0.7)
    return target, draft, torch.tensor([[1, 3, 0, 4]])


# (policy, budget, delta, sampling options): dyspec's threshold is delta / budget
DISTRIBUTION_CASES = [
    ("static", 4, 0.2, {}),
    ("eagle2", 4, 0.2, {}),  # sampled children (the default at temperature > 0)
    ("opt", 5, 0.1, {"top_p": 0.8, "temperature": 0.7}),
    ("opt", 4, 0.2, {"children": "top", "top_k": 3}),
    ("static", 4, 0.2, {"children": "sampled"}),
    ("sequoia", 4, 0.2, {}),
    ("sequoia", 6, 0.2, {"top_p": 0.8}),
    ("dyspec", 4, 0.6, {}),
    ("dyspec", 5, 0.6, {"top_k": 3, "temperature": 0.8}),
    ("sequoia", 4, 0.2, {"draft_temperature": 0.5}),  # children drawn from a sharpened draft
    ("dyspec", 4, 0.6, {"draft_temperature": 2.0}),  # ... and from a flattened one
]


@pytest.mark.parametrize("tree,budget,delta,warp", DISTRIBUTION_CASES)
def test_sampled_tokens_follow_the_target_distribution(small_pair, tree, budget, delta, warp):
    target, draft, prompt = small_pair
    warp = {"temperature": 1.0, **warp}
    draft_temperature = warp.pop("draft_temperature", 1.0)
    children = warp.pop("children", "auto")
    exact = exact_joint(target, prompt, STEPS, **warp)
    counts = sample_counts(target, draft, prompt, STEPS, FOLLOW_RUNS, tree=tree, budget=budget, delta=delta, max_depth=2,
                           draft_temperature=draft_temperature, children=children, **warp)
    assert chi_square_pvalue(counts, exact, FOLLOW_RUNS) > 1e-3


def test_distribution_cases_draw_branching_trees_verified_the_intended_way(small_pair):
    """The distribution test is only as good as its trees: they branch, go deeper than one layer,
    and carry draft distributions exactly when their children were sampled."""
    target, draft, prompt = small_pair
    for tree, budget, delta, warp in DISTRIBUTION_CASES:
        warp = {"temperature": 1.0, **{k: v for k, v in warp.items() if k != "draft_temperature"}}
        configs = [SpecConfig(tree=tree, budget=budget, delta=delta, max_depth=2, seed=s, **warp) for s in range(5)]
        built = [make_policy(config).build(_drafter(draft, prompt), prompt[0], 2) for config in configs]
        assert any(t.max_depth == 2 for t in built), tree
        assert any(bool(torch.bincount(t.parents + 1).max() >= 2) for t in built), tree
        sampled = warp.get("children", "auto") == "sampled" or warp.get("children", "auto") == "auto" and tree != "static"
        assert all((t.draft_probs is not None) == sampled for t in built), (tree, warp)


def _drafter(draft, prompt):
    from opttree.step.drafters import ModelDrafter

    drafter = ModelDrafter(draft)
    drafter.start(prompt[0])
    return drafter


def test_the_check_detects_a_top_k_tree_verified_by_rejection_sampling(small_pair, monkeypatch):
    """Test of the test: Sequoia's tree with its children taken as the draft's top-ranked tokens
    instead of sampled, still verified with min(1, p/q), is biased (rejection sampling is exact only for candidates
    sampled from the draft), and caught."""
    target, draft, prompt = small_pair

    def top_ranked(probs, k, generator):
        tokens = probs.topk(min(k, probs.shape[-1]), dim=-1).indices
        return tokens, torch.ones_like(tokens, dtype=torch.bool)

    monkeypatch.setattr(shapes, "draw_distinct", top_ranked)
    exact = exact_joint(target, prompt, STEPS, temperature=1.0)
    counts = sample_counts(target, draft, prompt, STEPS, RUNS, tree="sequoia", budget=4, max_depth=2, temperature=1.0)
    assert chi_square_pvalue(counts, exact, RUNS) < 1e-3


def _path_distribution(vocab: int, seed: int, support: int, sharpness: float):
    """A fixed random distribution per path, with `support` tokens of positive probability."""

    def dist(path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((seed,) + path) % 2**31)
        logits = sharpness * torch.randn(vocab, generator=g)
        logits[torch.randperm(vocab, generator=g)[support:]] = float("-inf")
        return logits.softmax(-1)

    return dist


def rejection_sampling_pvalue(vocab, width, p_support, q_support, runs=6000) -> float:
    """Verifier alone: two layers of children drawn without replacement from q (`width` per node);
    chi-square p-value of the first two emitted tokens against the exact p(a) p(b | a)."""
    target = _path_distribution(vocab, 1, p_support, 1.5)
    draft = _path_distribution(vocab, 2, q_support, 1.5)
    g = torch.Generator().manual_seed(0)
    counts = Counter()
    for _ in range(runs):
        root_kids, ok = sample_without_replacement(draft(()).log()[None], width, g)
        root_kids = root_kids[0, ok[0]].tolist()
        tokens, parents, probs, targets = list(root_kids), [-1] * len(root_kids), [draft(())], [target(())]
        for i, a in enumerate(root_kids):
            probs.append(draft((a,)))
            targets.append(target((a,)))
        for i, a in enumerate(root_kids):
            kids, ok = sample_without_replacement(draft((a,)).log()[None], width, g)
            for b in kids[0, ok[0]].tolist():
                tokens.append(b)
                parents.append(i)
                probs.append(torch.zeros(vocab))  # leaves: never read
                targets.append(target((a, b)))
        n = len(tokens)
        depths = torch.tensor([1 if parent < 0 else 2 for parent in parents])
        tree = opttree.DraftTree(torch.tensor(tokens), torch.tensor(parents), depths,
                                 torch.zeros(n), torch.arange(n), draft_probs=torch.stack(probs))
        path, length, bonus = accept_rejection_sampling(tree, torch.stack(targets), g, siblings=width)
        emitted = [tokens[i] for i in path[: int(length)].tolist()] + [int(bonus)]
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(target((emitted[0],)), 1, generator=g)))
        counts[tuple(emitted[:2])] += 1
    exact = {(a, b): float(target(())[a] * target((a,))[b]) for a in range(vocab) for b in range(vocab)}
    exact = {cell: p for cell, p in exact.items() if p > 0}
    return chi_square_pvalue(counts, exact, runs)


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("vocab,width,p_support,q_support", [(4, 3, 4, 4), (5, 2, 3, 5), (5, 4, 5, 2)])
def test_rejection_sampling_emits_the_target_distribution(vocab, width, p_support, q_support, where, monkeypatch):
    """Including p and q of different supports (as top-k / top-p make them); walked on the host and decided on
    the device (`verify.rejection_on_device`)."""
    monkeypatch.setenv("OPTTREE_REJECTION", where)
    assert rejection_sampling_pvalue(vocab, width, p_support, q_support) > 1e-3


@pytest.mark.parametrize("where", ["host", "device"])
def test_the_check_detects_rejection_sampling_that_forgets_the_rejected_draw(where, monkeypatch):
    """Test of the test: not removing a rejected token from q (drawing siblings as if with replacement)."""
    import opttree.step.verify

    monkeypatch.setenv("OPTTREE_REJECTION", where)

    rejected = opttree.step.verify._rejected
    monkeypatch.setattr(opttree.step.verify, "_rejected", lambda p, q, x: (rejected(p, q, x)[0], q))
    assert rejection_sampling_pvalue(4, 3, 4, 4) < 1e-3


# ---------------------------------------------------------------- the trees themselves


def check_tree(tree, drafter, n, max_depth):
    """Connected, sorted by depth, within budget and depth, distinct siblings, and scores equal to
    the draft's path log-probabilities (so every node was run with the right parent slot); sampled children
    valued by draw rank (`tree.keys` kept): their p-hat, the parent's times that of the rank, and undrawn nodes
    (where a row's draws held fewer distinct tokens) keyed -inf, their subtrees too."""
    assert 1 <= len(tree) <= n and tree.max_depth <= max_depth
    assert bool((tree.parents < torch.arange(len(tree))).all())
    parent_depth = torch.where(tree.parents >= 0, tree.depths[tree.parents.clamp(min=0)], 0)
    assert torch.equal(tree.depths, parent_depth + 1)
    paths = [path_of(tree, i) for i in range(len(tree))]
    drawn = tree.drawn.tolist()
    assert len({p for p, d in zip(paths, drawn) if d}) == sum(drawn)
    for i, path in enumerate(paths):
        if not drawn[i]:  # a draw a peaked row could not make: never tried, nor is its subtree
            assert float(tree.scores[i]) == float("-inf") and tree.keys is not None
            continue
        if tree.keys is None:
            logp = sum(float(drafter.logq(path[:d])[path[d]]) for d in range(len(path)))
            assert float(tree.scores[i]) == pytest.approx(logp, abs=1e-4)
        else:  # the draw's rank among its siblings (they are kept in draw order)
            parent, rank = int(tree.parents[i]), tree.parents[:i].tolist().count(int(tree.parents[i]))
            above = float(tree.scores[parent]) if parent >= 0 else 0.0
            assert float(tree.scores[i]) == pytest.approx(above + float(rank_log_acceptance(DEFAULT_ACCEPTANCE,
                                                                                           rank + 1)[rank]), abs=1e-5)
    assert bool(ancestor_mask(tree.parents).diagonal().all())


def test_draws_without_replacement_are_exact_and_short_only_where_the_draws_repeat(monkeypatch):
    """`sample_without_replacement` on 5 tokens, one of which can never be drawn, 60,000 rows at once: the first
    draw follows q, each next one q without the earlier ones, whenever it exists (a row whose draws repeat gets
    fewer children, always its last ones, and whether it does never depends on the missing child's token).
    Tested per history: b given a among rows with a second child, c given (a, b) among rows with a third; the
    same test refuses those counts against a 1.5 % bias in the expected ones. With 4 draws a child and no
    floor (MIN_DRAWS), so that some rows do come short."""
    from scipy.stats import chisquare

    from opttree.step import sampling

    monkeypatch.setattr(sampling, "MIN_DRAWS", 0)

    q = torch.tensor([0.4, 0.25, 0.2, 0.15, 0.0])
    rows = 60_000
    tokens, valid = sample_without_replacement(q.log().expand(rows, 5), 3, torch.Generator().manual_seed(0))
    assert valid[:, 0].all() and (tokens[valid] != 4).all()
    assert (valid[:, 1:].long() <= valid[:, :-1].long()).all() and 0.9 * rows < valid[:, 2].sum() < rows
    assert (tokens[:, 0] != tokens[:, 1])[valid[:, 1]].all() and (tokens[:, 2] != tokens[:, :2].T).all(0)[valid[:, 2]].all()
    observed, expected = [], []
    for history in [()] + [(a,) for a in range(4)] + [(a, b) for a in range(4) for b in range(4) if a != b]:
        depth = len(history)
        rows_here = valid[:, depth] & (tokens[:, :depth] == torch.tensor(history, dtype=torch.long)).all(1)
        drawn = Counter(tokens[rows_here, depth].tolist())
        rest = 1 - float(q[list(history)].sum())
        for x in range(4):
            if x not in history:
                observed.append(drawn.get(x, 0))
                expected.append(int(rows_here.sum()) * float(q[x]) / rest)
    observed, expected = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    strata = 1 + 4 + 12
    assert chisquare(observed, expected, ddof=strata - 1, sum_check=False).pvalue > 1e-3
    biased = expected.clone()
    biased[0], biased[1] = expected[0] + 0.015 * rows, expected[1] - 0.015 * rows  # 1.5 % moved between first draws
    assert chisquare(observed, biased, ddof=strata - 1, sum_check=False).pvalue < 1e-4
    peaked = torch.tensor([[0.999, 0.001, 0.0, 0.0, 0.0]]).log()
    _, valid = sample_without_replacement(peaked.expand(1000, 5), 3, torch.Generator().manual_seed(1))
    assert not valid[:, 2].any() and valid[:, 0].all() and 0 < valid[:, 1].sum() < 100  # 1 - 0.999^12 = 1.2 %


def test_one_draw_a_row_follows_q_and_marks_a_row_without_mass():
    """One child a row (`draw_distinct` with k = 1, its own short path): 60,000 draws from q follow it (and the
    same counts refuse q with 1.5 % of its mass moved); a token without mass is never drawn; a row without any mass
    gives an invalid child (an id in range)."""
    from scipy.stats import chisquare

    from opttree.step.sampling import draw_distinct

    q = torch.tensor([0.4, 0.25, 0.2, 0.15, 0.0])
    rows = 60_000
    tokens, valid = draw_distinct(torch.cat([q.expand(rows, 5), torch.zeros(1, 5)]), 1, torch.Generator().manual_seed(0))
    assert tokens.shape == valid.shape == (rows + 1, 1) and valid[:rows].all() and not valid[rows].any()
    assert 0 <= int(tokens[rows]) < 5 and (tokens[:rows] != 4).all()
    observed = torch.bincount(tokens[:rows, 0], minlength=5)[:4].double()
    expected = rows * q[:4].double()
    assert chisquare(observed, expected).pvalue > 1e-3
    biased = expected + torch.tensor([0.015, -0.015, 0.0, 0.0], dtype=torch.float64) * rows
    assert chisquare(observed, biased).pvalue < 1e-4


@pytest.mark.parametrize("seed", range(4))
def test_the_drafters_slot_tree_gives_each_slots_depth_and_ancestors(seed):
    """`SlotTree` (a model drafter's slots of one step, in buffers that double) against the tree it describes,
    layer by layer, past its first capacity: each new slot's depth and the slots it may attend to (its ancestors
    and itself, among every slot so far)."""
    from opttree.step.drafters.model import SlotTree

    g = torch.Generator().manual_seed(seed)
    slots = SlotTree(torch.device("cpu"), capacity=4)
    for widths in ((3, 5, 1, 7, 2), (2, 6, 3), (1, 1, 9)):  # steps: the buffers kept from one to the next
        slots.reset()
        if seed % 2:  # a chain's first slots before the tree's
            for _ in range(widths[-1]):
                slots.add_child_of_last()
        parents: list[int] = list(range(-1, slots.size - 1))
        for width in widths:
            new = [int(torch.randint(-1, len(parents), (1,), generator=g)) if parents else -1 for _ in range(width)]
            depths, allowed = slots.add(torch.tensor(new))
            parents += new
            every = ancestor_mask(torch.tensor(parents))  # (S, S)
            assert torch.equal(allowed, every[-width:])
            assert torch.equal(depths, every[-width:].sum(dim=1)) and torch.equal(slots.depths, every.sum(dim=1))


@pytest.mark.parametrize("tree_name", POLICIES)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("n,depth,temperature", [(1, 3, 0.0), (7, 3, 0.0), (30, 5, 0.0), (10, 4, 1.0)])
def test_trees_are_valid(tree_name, seed, n, depth, temperature):
    drafter = ScriptedDrafter(6, seed=seed, sharpness=2.0)
    policy = make_policy(SpecConfig(tree=tree_name, budget=n, delta=0.2, max_depth=depth,
                                    temperature=temperature, seed=seed))
    tree = policy.build(drafter, torch.tensor([0]), depth_limit=100)
    check_tree(tree, drafter, n, depth)
    sampled = temperature > 0 and tree_name in ("sequoia", "eagle2", "dyspec")  # children="auto"
    assert (tree.draft_probs is not None) == sampled
    if sampled:  # rows of the nodes that have children are q at that node
        has_child = set(tree.parents.tolist()) - {-1}
        assert torch.allclose(tree.draft_probs[0], drafter.logq(()).exp(), atol=1e-6)
        for i in has_child:
            assert torch.allclose(tree.draft_probs[i + 1], drafter.logq(path_of(tree, i)).exp(), atol=1e-6)
    tree = policy.build(drafter, torch.tensor([0]), depth_limit=2)
    assert tree.max_depth <= 2


def test_a_fixed_tree_drops_the_ranks_a_small_vocabulary_cannot_fill():
    """Token Recycling's tree gives the root 8 children; over 6 tokens its plan keeps the paths whose every rank
    is below 6 (a path past it goes with its subtree), top-ranked, with their path log-probabilities."""
    drafter = ScriptedDrafter(6, seed=1)
    policy = make_policy(SpecConfig(tree="recycling-template", budget=80, max_depth=6))
    tree = policy.build(drafter, torch.tensor([0]), depth_limit=100)
    check_tree(tree, drafter, 80, 6)
    kept = sorted((p for p in policy.paths if max(p) < 6), key=lambda p: (len(p), p))
    ranks = [tuple(int((drafter.logq(path[:d]) > drafter.logq(path[:d])[path[d]]).sum()) for d in range(len(path)))
             for path in (path_of(tree, i) for i in range(len(tree)))]
    assert len(kept) < 80 and ranks == kept


def test_static_trees_are_their_first_budget_paths():
    drafter = ScriptedDrafter(5, seed=3)
    for name, budget, depth in [("static", 9, 4), ("static-k2", 11, 3), ("static-k3", 5, 3)]:
        tree = make_policy(SpecConfig(tree=name, budget=budget, max_depth=depth)).build(drafter, torch.tensor([0]), 100)
        ranks = []
        for i in range(len(tree)):
            path = path_of(tree, i)
            ranks.append(tuple(int((drafter.logq(path[:d]) > drafter.logq(path[:d])[path[d]]).sum())
                               for d in range(len(path))))
        if name == "static":
            expected = ranked_paths(DEFAULT_RANK_WEIGHTS, budget, depth)
        else:
            expected = kary_paths(int(name[-1]), budget, depth)
        assert sorted(ranks) == sorted(expected)


def test_ranked_and_kary_paths():
    assert kary_paths(2, 5, 3) == [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    assert len(kary_paths(3, 100, 2)) == 12
    paths = ranked_paths((0.6, 0.3, 0.1), 20, 4)
    assert len(paths) == 20 and max(len(p) for p in paths) <= 4
    values = [torch.tensor([(0.6, 0.3, 0.1)[r] for r in p]).prod() for p in paths]
    assert all(a >= b - 1e-9 for a, b in zip(values, values[1:]))  # best first
    for i, p in enumerate(paths):  # each path after its parent and its lower-ranked sibling
        assert len(p) == 1 or p[:-1] in paths[:i]
        assert p[-1] == 0 or p[:-1] + (p[-1] - 1,) in paths[:i]


def test_custom_static_tree(pair, monkeypatch):
    registry = opttree.step.policies.registry
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # forget them afterwards
    target, draft = pair
    register_static_tree("test-custom", [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2]])
    policy = make_policy(SpecConfig(tree="test-custom", budget=5, max_depth=8))
    assert [len(p) for p in policy.paths] == [1, 1, 2, 2, 2]  # first 5 paths
    prompt = prompts(1, seed=3)[0]
    out = opttree.generate(target, prompt, draft, tree="test-custom", budget=6, max_new_tokens=20, eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 20))
    register_static_tree("test-bad-order", [[0], [0, 0, 0], [0, 0]])
    with pytest.raises(ValueError, match="before its parent"):
        make_policy(SpecConfig(tree="test-bad-order", budget=3))
    with pytest.raises(ValueError, match="no parent"):
        check_paths([[0], [1, 0]])


def test_eagle2_runs_the_top_k_of_each_layer():
    drafter = ScriptedDrafter(12, seed=4)
    n, depth = 20, 4
    k = eagle2_top_k(n)
    assert k == 5 and eagle2_top_k(60) == 8 and eagle2_top_k(1) == 2 and eagle2_top_k(10**4) == 10
    tree = make_policy(SpecConfig(tree="eagle2", budget=n, max_depth=depth)).build(drafter, torch.tensor([0]), 100)
    assert drafter.expand_calls == [k] * (depth - 1)
    # brute force: k best of each layer expanded, all k * k children are candidates, best n overall
    layer = sorted(((float(drafter.logq(())[t]), (t,)) for t in range(12)), reverse=True)[:k]
    candidates = list(layer)
    for _ in range(depth - 1):
        expanded = sorted(layer, reverse=True)[:k]
        layer = []
        for score, path in expanded:
            logq = drafter.logq(path)
            layer += sorted(((score + float(logq[t]), path + (t,)) for t in range(12)), reverse=True)[:k]
        candidates += layer
    best = sorted(candidates, key=lambda c: -c[0])[:n]
    assert sorted(path_of(tree, i) for i in range(len(tree))) == sorted(p for _, p in best)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n,delta", [(12, 0.3), (40, 0.5), (6, 0.0)])
def test_dyspec_grows_while_values_exceed_the_threshold(seed, n, delta):
    """Greedy variant: children by rank; a child was offered while v * (1 - mass of its earlier
    siblings) > threshold; a node stops offering only below the threshold, at max depth or when
    the budget is spent; one drafter forward per layer."""
    vocab, depth = 6, 4
    drafter = ScriptedDrafter(vocab, seed=seed, sharpness=3.0)
    tree = make_policy(SpecConfig(tree="dyspec", budget=n, delta=delta, max_depth=depth)).build(
        drafter, torch.tensor([0]), 100)
    threshold = delta / n
    check_tree(tree, drafter, n, depth)
    assert len(drafter.expand_calls) == tree.max_depth - 1  # an expanded node always gets a child
    paths = {path_of(tree, i) for i in range(len(tree))}
    for node in [()] + sorted(paths):
        value = 1.0 if not node else float(torch.tensor([float(drafter.logq(node[:d])[node[d]]) for d in range(len(node))]).sum().exp())
        q = drafter.logq(node).exp()
        kids = [p[-1] for p in paths if len(p) == len(node) + 1 and p[:-1] == node]
        order = q.argsort(descending=True).tolist()
        assert sorted(kids) == sorted(order[: len(kids)])  # top-ranked
        taken = float(q[kids].sum()) if kids else 0.0
        next_offer = value * (1 - taken)
        offered = [value * (1 - float(q[order[:i]].sum())) for i in range(len(kids))]
        assert all(o > threshold for o in offered)
        if len(node) < depth and len(kids) < vocab and next_offer > threshold:
            assert len(tree) == n  # only the budget stopped it


# ---------------------------------------------------------------- Sequoia's dynamic programme


def brute_force_best(acc, n, depth):
    """Every forest of at most n nodes, at most `depth` levels, children on ranks 0, 1, ...: best value."""

    def forests(d, m, r):  # (size, value) of every forest below a node using ranks r, r + 1, ...
        yield 0, 0.0
        if d == 0 or m == 0 or r == len(acc):
            return
        for sub_size, sub_value in list(forests(d - 1, m - 1, 0)):
            for rest_size, rest_value in list(forests(d, m - 1 - sub_size, r + 1)):
                yield 1 + sub_size + rest_size, acc[r] * (1 + sub_value) + rest_value

    return max(value for _, value in forests(depth, n, 0))


@pytest.mark.parametrize("acc", [(0.6, 0.2, 0.1), (0.3, 0.5, 0.05), (0.9,), (0.25, 0.25, 0.25, 0.25), (0.05, 0.0, 0.9)])
@pytest.mark.parametrize("n,depth", [(1, 1), (3, 2), (5, 3), (7, 2), (7, 4), (8, 3)])
def test_sequoia_tree_is_the_brute_force_optimum(acc, n, depth):
    paths = sequoia.optimal_tree(acc, n, depth)
    assert len(paths) <= n and max(len(p) for p in paths) <= depth
    for p in paths:  # prefix-closed, children on contiguous ranks
        assert len(p) == 1 or p[:-1] in paths
        assert p[-1] == 0 or p[:-1] + (p[-1] - 1,) in paths
    assert sequoia.tree_value(acc, paths) == pytest.approx(brute_force_best(acc, n, depth), abs=1e-12)


@pytest.mark.parametrize("n,depth", [(4, 3), (16, 5), (64, 12)])
def test_sequoia_equals_greedy_top_n_for_a_decreasing_vector(n, depth):
    """With acc non-increasing, the n best paths by product form a valid tree, so they are optimal."""
    acc = sequoia.DEFAULT_ACCEPTANCE
    best = sequoia.tree_value(acc, ranked_paths(acc, n, depth))
    assert sequoia.tree_value(acc, sequoia.optimal_tree(acc, n, depth)) == pytest.approx(best, rel=1e-9)


def test_sequoia_uses_the_configured_vector():
    default = make_policy(SpecConfig(tree="sequoia", budget=6, max_depth=6)).paths
    wide = make_policy(SpecConfig(tree="sequoia", budget=6, max_depth=6, acceptance=[0.3, 0.3, 0.3])).paths
    assert sum(len(p) == 1 for p in wide) == 3  # wide: the root takes three children
    assert sum(len(p) == 1 for p in default) < 3
    with pytest.raises(ValueError, match="acceptance vector"):
        SpecConfig(tree="sequoia", acceptance=[0.8, 0.5])


def measure(target, draft, prompts_ids, width, temperature, new_tokens=8):
    pairs = paired_logits(target, draft, prompts_ids, temperature, new_tokens=new_tokens)
    return sequoia.acceptance_vector(pairs, width, temperature)


def test_measure_acceptance_vector(small_pair):
    target, draft, prompt = small_pair
    prompts_ids = [prompt, torch.tensor([2, 1])]
    for temperature in (0.0, 1.0):  # the target as its own draft: the first child is always accepted
        acc = measure(target, target, prompts_ids, width=3, temperature=temperature)
        assert acc == pytest.approx([1.0, 0.0, 0.0], abs=1e-6)
    for temperature, width in ((0.0, 5), (1.0, 4)):
        acc = measure(target, draft, prompts_ids, width=width, temperature=temperature)
        assert len(acc) == width and all(a >= 0 for a in acc) and sum(acc) <= 1 + 1e-9
        if temperature == 0:
            assert sum(acc) == pytest.approx(1.0)  # with width = vocab, the target's token has some rank
        assert sequoia.optimal_tree(acc, 8, 4)


def test_sequoia_profile_round_trip(small_pair):
    target, draft, prompt = small_pair
    entry = {mode: measure(target, target, [prompt], width=3, temperature=t, new_tokens=6)
             for mode, t in (("greedy", 0.0), ("sampled", 1.0))}
    assert entry == {"greedy": pytest.approx([1.0, 0, 0]), "sampled": pytest.approx([1.0, 0, 0])}
    profile = {sequoia.PROFILE_FIELD: entry}
    acc = sequoia.profile_vector(profile, greedy=False)
    paths = make_policy(SpecConfig(tree="sequoia", budget=5, max_depth=8, temperature=1.0, acceptance=acc)).paths
    assert [len(p) for p in paths] == [1, 2, 3, 4, 5]  # a perfect draft: one chain
    assert sequoia.profile_vector({}, greedy=True) is None
