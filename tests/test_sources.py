"""Draft sources (docs/METHODS.md): tries merged and cut, lookup and Token Recycling against
brute force, exact output with every source and combination, clear errors."""

import functools
import random

import pytest
import torch
from helpers import chi_square_pvalue, exact_joint, hf_greedy, sample_counts, tiny_model

import opttree
from opttree.settings.config import SpecConfig
from opttree.settings.drafter_spec import DrafterSpec
from opttree.step.drafters.estimates import forget, per_model
from opttree.step.drafters.lookup import NgramIndex, continuation_trie
from opttree.step.drafters.recycling import MAX_LISTED_MASS, RecyclingMatrix
from opttree.step.drafters.sources import LookupSource, TrieDrafter, prune_first_tokens
from opttree.step.tree import DraftTree, merge, merge_best, node_paths, top_nodes


def random_trie(rng: random.Random, vocab: int = 4, nodes: int = 12, slot_base: int | None = 0) -> DraftTree:
    """A random trie (distinct sibling tokens), parents first, decreasing scores down every path."""
    paths: list[tuple[int, ...]] = []
    while len(paths) < nodes:
        parent = rng.choice([()] + paths) if paths else ()
        path = parent + (rng.randrange(vocab),)
        if path not in paths and len(path) <= 4:
            paths.append(path)
    paths.sort(key=len)
    index = {p: i for i, p in enumerate(paths)}
    scores: list[float] = []
    for p in paths:
        scores.append((scores[index[p[:-1]]] if len(p) > 1 else 0.0) - rng.random())
    slots = list(range(len(paths))) if slot_base is not None else [-1] * len(paths)
    return DraftTree(torch.tensor([p[-1] for p in paths]), torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths]),
                     torch.tensor([len(p) for p in paths]), torch.tensor(scores), torch.tensor(slots))


def check_trie(tree: DraftTree) -> None:
    """Parents first, depths consistent, no two siblings with one token."""
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    for i, parent in enumerate(parents):
        assert parent < i and depths[i] == (depths[parent] + 1 if parent >= 0 else 1)
    assert len(set(node_paths(tree))) == len(tree)


@pytest.mark.parametrize("seed", range(20))
def test_merge_is_the_union_of_the_paths(seed):
    rng = random.Random(seed)
    a, b = random_trie(rng), random_trie(rng, slot_base=None)
    merged = merge(a, b)
    check_trie(merged)
    score = {p: s for p, s in zip(node_paths(merged), merged.scores.tolist())}
    slot = dict(zip(node_paths(merged), merged.draft_slots.tolist()))
    pa, pb = dict(zip(node_paths(a), a.scores.tolist())), dict(zip(node_paths(b), b.scores.tolist()))
    assert set(score) == set(pa) | set(pb)
    for p in score:
        assert score[p] == pytest.approx(max(pa.get(p, -1e9), pb.get(p, -1e9)))
        assert slot[p] == (dict(zip(node_paths(a), a.draft_slots.tolist()))[p] if p in pa else -1)


@pytest.mark.parametrize("seed", range(20))
def test_top_nodes_keeps_the_best_connected_nodes(seed):
    rng = random.Random(seed)
    tree = merge(random_trie(rng), random_trie(rng, slot_base=None))  # scores no longer fall along every path
    n = rng.randrange(1, len(tree) + 2)
    kept = top_nodes(tree, n)
    check_trie(kept)
    paths, scores = node_paths(tree), dict(zip(node_paths(tree), tree.scores.tolist()))
    path_min = {p: min(scores[p[:d]] for d in range(1, len(p) + 1)) for p in paths}
    chosen = set(node_paths(kept))
    assert len(chosen) == min(n, len(tree))
    worst_kept = min(path_min[p] for p in chosen)
    assert all(path_min[p] <= worst_kept for p in paths if p not in chosen)  # brute force: no better node left out


@pytest.mark.parametrize("where", ["device", "host"])
@pytest.mark.parametrize("seed", range(40))
def test_merge_best_is_the_best_nodes_of_the_union(seed, where, monkeypatch):
    """Brute force: the union made by `merge` and cut by `top_nodes`, against `merge_best` on the device and on the
    host (`merge_on_host`). Small vocabularies make many shared paths; up to three tries merged into the first."""
    monkeypatch.setenv("OPTTREE_MERGE", where)
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 4, 8])
    tries = [random_trie(rng, vocab, rng.randrange(1, 14))] + [
        random_trie(rng, vocab, rng.randrange(1, 14), slot_base=None) for _ in range(rng.randrange(1, 4))]
    n, floor = rng.randrange(1, 30), rng.choice([float("-inf"), -1.5])
    union = functools.reduce(merge, tries)
    expected = top_nodes(union, n, by=union.scores.masked_fill(union.scores < floor, float("-inf")))
    got = merge_best(tries, n, floor)
    for name in ("tokens", "parents", "depths", "draft_slots"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert torch.allclose(got.scores, expected.scores)


@pytest.mark.parametrize("seed", range(60))
def test_merge_best_on_the_host_is_the_devices_bit_for_bit(seed, monkeypatch):
    """Ties included (scores drawn from a few values, -inf among them), empty tries, n past the union's size."""
    rng = random.Random(1000 + seed)
    vocab = rng.choice([2, 3, 8])
    tries = [random_trie(rng, vocab, rng.randrange(1, 14), slot_base=rng.choice([0, None]))
             for _ in range(rng.randrange(2, 5))]
    for i, trie in enumerate(tries):
        if rng.random() < 0.15:
            fields = (trie.tokens, trie.parents, trie.depths, trie.scores, trie.draft_slots)
            tries[i] = DraftTree(*(t[:0] for t in fields))
        elif rng.random() < 0.5:  # equal scores and -inf ones (a policy's candidates past its stop)
            depth_scores = torch.tensor([-0.5, -1.0, float("-inf"), float("-inf"), float("-inf")])
            tries[i] = DraftTree(trie.tokens, trie.parents, trie.depths, depth_scores[trie.depths - 1],
                                 trie.draft_slots)
    n, floor = rng.randrange(1, 30), rng.choice([float("-inf"), -0.7])
    results = []
    for where in ("device", "host"):
        monkeypatch.setenv("OPTTREE_MERGE", where)
        results.append(merge_best(tries, n, floor))
    for name in ("tokens", "parents", "depths", "draft_slots", "scores"):
        assert torch.equal(getattr(results[0], name), getattr(results[1], name)), name
    device, host = results
    assert host.host_parents == tuple(host.parents.tolist()) and torch.equal(host.block, device.block)


def test_merge_best_fills_a_fixed_size_without_reading_the_device(monkeypatch):
    """The first trie holds n nodes, two scored -inf (candidates past a stop decided on the device): the merge
    keeps every finite node first, then those, never a second node for one path, and reads nothing back."""
    from opttree.counters import StepCounter

    monkeypatch.setenv("OPTTREE_MERGE", "device")  # as on a GPU (on a CPU the host unites them: `merge_on_host`)
    inf = float("-inf")
    base = DraftTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, -1, 0, 1]), torch.tensor([1, 1, 2, 2]),
                     torch.tensor([-0.1, -0.2, inf, inf]), torch.tensor([0, 1, 2, 3]))
    extra = DraftTree(torch.tensor([1, 5]), torch.tensor([-1, 0]), torch.tensor([1, 2]), torch.tensor([-0.05, -0.3]),
                      torch.tensor([-1, -1]))
    with StepCounter() as counter:
        merged = merge_best([base, extra], 4)
    assert counter.host_syncs == 0 and counter.shape_syncs == 0
    check_trie(merged)
    assert node_paths(merged) == [(1,), (2,), (1, 3), (1, 5)]
    assert merged.scores.tolist() == pytest.approx([-0.05, -0.2, inf, -0.3])
    assert merged.draft_slots.tolist() == [0, 1, 2, -1]


def test_top_nodes_drops_impossible_nodes():
    tree = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 0]), torch.tensor([1, 1, 2]),
                     torch.tensor([-0.1, float("-inf"), -0.5]), torch.tensor([-1, -1, -1]))
    assert node_paths(top_nodes(tree, 5)) == [(1,), (1, 3)]


@pytest.mark.parametrize("seed", range(10))
def test_ngram_matches_agree_with_a_scan(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
    index = NgramIndex(max_n=3)
    cut = rng.randrange(len(tokens) + 1)
    index.extend(tokens[:cut])
    index.extend(tokens[cut:])  # incremental = at once
    n, starts = index.matches(limit=4)
    end = len(tokens)
    for length in range(min(3, end), 0, -1):  # brute force: the longest suffix seen earlier
        suffix = tokens[end - length:]
        found = [s + length for s in range(end - length) if tokens[s:s + length] == suffix]
        if found:
            assert (n, starts) == (length, found[-4:])
            break
    else:
        assert (n, starts) == (0, [])


def test_continuation_trie_counts_shares():
    trie, paths = continuation_trie([[1, 2, 9], [1, 2, 9], [1, 3]], torch.log(torch.tensor([0.5, 0.5, 0.5])))
    check_trie(trie)
    score = dict(zip(node_paths(trie), trie.scores.exp().tolist()))
    # shares 3/3, 2/3, 1/3, 2/3 times 0.5 per level
    assert score == pytest.approx({(1,): 0.5, (1, 2): 0.25 * 2 / 3, (1, 3): 0.25 / 3, (1, 2, 9): 0.125 * 2 / 3})
    assert paths == node_paths(trie)  # the paths come from the host, as the trie was built
    # cut to n nodes: the n best by score (1: 0.5, 1 2: 0.2, 1 2 9: 0.14, 1 3: 0.1), parents first
    kept = {1: [(1,)], 2: [(1,), (1, 2)], 3: [(1,), (1, 2), (1, 2, 9)], 4: [(1,), (1, 2), (1, 3), (1, 2, 9)]}
    for n, expected in kept.items():
        cut, cut_paths = continuation_trie([[1, 2, 9], [1, 2, 9], [1, 3]], torch.log(torch.tensor([0.5, 0.6, 0.7])), n)
        check_trie(cut)
        assert cut_paths == node_paths(cut) == expected


def test_recycling_matrix_rows_and_hit_rates():
    matrix = RecyclingMatrix(vocab=20, width=4)
    logits = torch.randn(2, 20)
    matrix.record(torch.tensor([3, 7]), logits)
    assert torch.equal(matrix.next[3].long(), logits[0].topk(4).indices)
    dist = matrix.log_dist(torch.tensor([3, 5]), torch.tensor([0, 1])).exp()  # (2, V)
    assert torch.allclose(dist.sum(1), torch.ones(2))
    assert torch.allclose(dist[1], torch.full((20,), 1 / 20))  # row 5 was never written: uniform
    listed = dist[0, logits[0].topk(4).indices]
    assert float(listed.sum()) <= MAX_LISTED_MASS + 4 / 20 and bool((listed[:-1] >= listed[1:]).all())
    before = matrix.rates.mean[0].clone()
    choice = logits[0].topk(4).indices[1]  # the target chose M[3]'s rank 1
    matrix.observe_hits(torch.tensor([3, 5]), torch.tensor([0, 0]), choice.view(1).expand(2))
    after = matrix.rates.mean[0]
    assert after[1] > before[1] and after[0] < before[0] and after[2] < before[2]  # row 5 (unset) is not scored


def test_trie_drafter_answers_from_the_trie():
    class Fixed:
        def __init__(self, trie):
            self.trie = trie

        def start(self, ids):
            pass

        def propose(self, committed, max_nodes, max_depth):
            return self.trie

    trie, _ = continuation_trie([[1, 2], [1, 3]], torch.zeros(2))
    drafter = TrieDrafter(Fixed(trie), vocab=6, max_nodes=8, max_depth=2)
    root = drafter.root(torch.tensor([4]))
    assert root[1].exp() == pytest.approx(1.0) and torch.isinf(root[torch.arange(6) != 1]).all()
    rows = drafter.expand(torch.tensor([1]), torch.tensor([-1])).exp()
    assert rows[0, 2] == pytest.approx(0.5) and rows[0, 3] == pytest.approx(0.5) and rows[0].sum() == pytest.approx(1.0)


def test_listed_children_are_the_best_of_the_full_rows():
    """`top_children`: recycling's and a trie's listed children are the top of the rows they would return."""
    matrix = RecyclingMatrix(vocab=30, width=6)
    matrix.record(torch.tensor([3, 7]), torch.randn(2, 30))
    matrix.rates.update((torch.tensor([0, 0, 1]), torch.tensor([2, 4, 0])), torch.tensor([True, True, False]),
                        torch.ones(3, dtype=torch.bool))  # hit rates no longer fall with the rank
    tokens, depths = torch.tensor([3, 5, 7]), torch.tensor([0, 1, 1])  # row 5 was never written
    rows = matrix.log_dist(tokens, depths)
    for k in (2, 6, 9):
        listed, logq = matrix.top(tokens, depths, k)
        assert listed.shape == (3, min(k, 6))
        assert torch.allclose(logq, rows.topk(min(k, 6), dim=1).values)
        assert torch.equal(rows.gather(1, listed), logq)  # the listed tokens carry those values
        assert all(len(set(row)) == len(row) for row in listed.tolist())  # distinct children

    class Fixed:
        def start(self, ids):
            pass

        def propose(self, committed, max_nodes, max_depth):
            return continuation_trie([[1, 2], [1, 3], [1, 3], [4]], torch.zeros(4))[0]

    drafter = TrieDrafter(Fixed(), vocab=6, max_nodes=8, max_depth=2)
    tokens, logq = drafter.root_top(torch.tensor([0]), 5)
    assert tokens.tolist() == [1, 4] and torch.allclose(logq.exp(), torch.tensor([0.75, 0.25]))
    tokens, logq = drafter.expand_top(tokens, torch.tensor([-1, -1]), 1)  # the best child of (1,); (4,) has none
    assert tokens[0].tolist() == [3] and logq[0].exp().tolist() == pytest.approx([2 / 3])
    assert logq[1].tolist() == [float("-inf")]


@pytest.mark.parametrize("seed", range(6))
def test_recycling_listed_on_the_host_builds_the_tensors_tree(seed):
    """OPT-Tree over Token Recycling from children listed on the host (NumPy, a CPU matrix) against the same policy
    asking the matrix's tensors: the same tree bit for bit (tokens, parents, depths, float32 scores, slots), over
    budgets, deltas and depth limits; hit rates made distinct so that no two candidates tie (ties may go either
    way). With rows never written (uniform children), still a tree of listed children, as many nodes."""
    from opttree.step.drafters.recycling import RecyclingDrafter
    from opttree.step.policies.opt import OptTree

    generator = torch.Generator().manual_seed(seed)
    vocab = 40

    class Target:  # the matrix is kept per target
        pass

    drafter = RecyclingDrafter(Target(), vocab)
    matrix = drafter.matrix
    assert drafter.lists_on_host
    matrix.write(torch.arange(vocab), torch.stack([torch.randperm(vocab, generator=generator)[:8]
                                                   for _ in range(vocab)]))
    matrix.rates.update((torch.arange(8).repeat_interleave(8), torch.arange(8).repeat(8)),
                        torch.rand(64, generator=generator) < 0.5)
    matrix.rates.hits += torch.rand(8, 8, generator=generator)  # distinct rates: no two candidates tie
    for budget, delta, depth in [(1, 0.0, 4), (4, 0.1, 3), (8, 0.0, 8), (16, 0.02, 6), (40, 0.0, 10), (64, 0.2, 12)]:
        policy = OptTree(SpecConfig(budget=budget, delta=delta, max_depth=depth))
        committed = torch.randint(0, vocab, (5,), generator=generator)
        tensors = policy._build_stop_on_host(drafter, committed, depth)
        host = policy._build_listed_on_host(drafter, committed, depth)
        for field in ("tokens", "parents", "depths", "scores", "draft_slots"):
            assert torch.equal(getattr(host, field), getattr(tensors, field)), (budget, field)
        assert host.host_parents == tensors.host_parents and len(host) == budget
    matrix.filled[torch.arange(0, vocab, 2)] = False  # half the rows never written: their children are uniform
    policy = OptTree(SpecConfig(budget=16, delta=0.0, max_depth=6))
    host = policy._build_listed_on_host(drafter, torch.tensor([2]), 6)  # the root's row too
    check_trie(host)
    assert len(host) == 16 and len(policy._build_stop_on_host(drafter, torch.tensor([2]), 6)) == 16
    parents_tokens = [2 if p < 0 else host.tokens[p].item() for p in host.parents.tolist()]
    for parent, token in zip(parents_tokens, host.tokens.tolist()):
        assert token in (matrix.next[parent].tolist() if matrix.filled[parent] else range(8))


def test_rasd_pruning_keeps_branches_whose_first_token_the_draft_ranks_high():
    trie, _ = continuation_trie([[1, 2], [3, 4]], torch.zeros(2))
    logq = torch.log_softmax(torch.tensor([0.0, 5.0, 0.0, -5.0, 0.0, 0.0, 0.0, 0.0]), 0)  # 3 ranks last
    pruned = prune_first_tokens(trie, logq, rank=4)
    assert {p for p, s in zip(node_paths(pruned), pruned.scores.tolist()) if s > float("-inf")} == {(1,), (1, 2)}
    assert set(node_paths(merge_best([pruned], 8))) == {(1,), (1, 2)}  # dropped by the merge


@pytest.fixture(scope="module")
def looping_pair():
    """A tiny target that repeats itself (as small models do) and a draft that half agrees with it."""
    target = tiny_model("llama", vocab=48, hidden=32, layers=2, seed=3, init=0.5)
    draft = tiny_model("llama", vocab=48, hidden=32, layers=1, seed=4, init=0.5)
    return target, draft


CASES = [  # (tree, drafter, uses the draft model)
    ("opt", "recycling", False), ("opt", "lookup", False), ("opt", "recycling+lookup", False),
    ("opt", "model+lookup", True), ("opt", "model+recycling", True), ("opt", "model+recycling+lookup", True),
    ("static", "recycling+lookup", False), ("chain", "lookup", False), ("eagle2", "recycling", False),
    ("dyspec", "recycling+lookup", False), ("sequoia", "model+lookup", True), ("recycling-template", "recycling", False),
]


@pytest.mark.parametrize("tree,drafter,with_model", CASES)
def test_greedy_output_is_exact_with_every_source(looping_pair, tree, drafter, with_model):
    target, draft = looping_pair
    forget(target)  # cold, then hot: the second prompt reuses what the first taught
    for seed in range(2):
        prompt = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(seed))
        expected = hf_greedy(target, prompt, 40, eos_token_id=None)
        out = opttree.generate(target, prompt, draft if with_model else None, tree=tree, drafter=drafter, budget=12,
                               max_new_tokens=40, eos_token_id=[])
        assert torch.equal(out.sequences, expected), (tree, drafter, seed)


def test_without_a_draft_model_the_default_is_train_free_and_drafts(looping_pair):
    target, _ = looping_pair
    prompt = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(7))
    run = opttree.stream(target, prompt, max_new_tokens=48, eos_token_id=[])
    for _ in run:
        pass
    assert str(run.config.drafter) == "recycling+lookup"
    assert torch.equal(run.sequences, hf_greedy(target, prompt, 48))
    assert run.stats.mean_accepted_length > 1.5  # a looping target: recycled and looked-up tokens are accepted


def test_max_depth_defaults_to_the_budget_without_a_draft_model(looping_pair):
    target, draft = looping_pair
    prompt = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(7))

    def depth(draft_model=None, **options) -> int:
        return opttree.stream(target, prompt, draft_model, max_new_tokens=8, **options).config.max_depth

    assert depth(budget=16) == 16 and depth(budget=4) == 8  # train-free: the budget, at least 8
    assert depth(draft, budget=16) == 8 and depth(draft, budget=16, drafter="model+lookup") == 8
    assert depth(budget=16, max_depth=3) == 3 and depth(draft, budget=16, max_depth=12) == 12  # given: kept
    assert depth(budget=16, max_depth=None) == 16


def test_recycling_is_kept_per_target_and_forgotten_on_request(looping_pair):
    target, _ = looping_pair
    forget(target)
    prompt = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(1))
    opttree.generate(target, prompt, drafter="recycling", max_new_tokens=16, eos_token_id=[])
    matrix = per_model(target, "recycling-48", lambda: None)
    assert matrix is not None and int(matrix.filled.sum()) > 0
    forget(target)
    assert per_model(target, "recycling-48", lambda: "cold") == "cold"


VOCAB, STEPS, RUNS = 5, 3, 1000


@pytest.mark.parametrize("drafter,tree,warp", [
    ("recycling+lookup", "opt", {"temperature": 1.0}),
    ("model+lookup", "opt", {"temperature": 0.8, "top_k": 3}),
    ("recycling", "dyspec", {"temperature": 1.0, "children": "sampled"}),  # sampled from the recycled distribution
    ("recycling+lookup", "opt", {"temperature": 1.0, "children": "sampled"}),  # recycling's draws, looked-up candidates
])
def test_sampled_tokens_follow_the_target_distribution(drafter, tree, warp):
    target = tiny_model("llama", vocab=VOCAB, hidden=32, layers=1, seed=11, init=0.6)
    draft = tiny_model("llama", vocab=VOCAB, hidden=32, layers=1, seed=12, init=0.6)
    prompt = torch.tensor([[1, 3, 0, 4, 1, 3]])
    counts = sample_counts(target, draft if drafter.startswith("model") else None, prompt, STEPS, RUNS, tree=tree,
                           drafter=drafter, budget=6, max_depth=3, **warp)
    warp.pop("children", None)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, STEPS, **warp), RUNS) > 1e-3


def test_source_errors_are_clear(looping_pair):
    target, draft = looping_pair
    ids = torch.tensor([[3, 4, 5]])
    cases = [
        (dict(drafter="lookup+magic"), None, "unknown draft source 'magic'"),
        (dict(drafter="lookup+lookup"), None, "names a source twice"),
        (dict(drafter="recycling"), draft, "does not use it"),
        (dict(drafter="model"), None, "needs a draft model"),
        (dict(drafter="lookup", draft_temperature=0.5), None, "draft_temperature applies to a draft model"),
        (dict(drafter="model+lookup", tree="dyspec", temperature=1.0, children="sampled"), draft,
         "takes one distribution source"),
        (dict(drafter="lookup", tree="sequoia", temperature=1.0, children="sampled"), None, "takes one distribution source"),
        (dict(drafter="model", children="random"), draft, "children must be one of auto, top, sampled"),
        (dict(drafter="recycling", tree="ar"), None, "drafts nothing"),
        (dict(drafter=""), None, "drafter must name draft sources"),
    ]
    for options, d, message in cases:
        with pytest.raises(ValueError, match=message):
            opttree.generate(target, ids, d, max_new_tokens=4, **options)


def test_a_drafter_spec_puts_distribution_sources_first_and_reads_declared_capabilities():
    assert DrafterSpec.parse("lookup+model").names == ("model", "lookup")
    assert DrafterSpec.parse("lookup+recycling").names == ("recycling", "lookup")
    assert DrafterSpec.parse(" lookup ").names == ("lookup",) and str(DrafterSpec.parse("lookup+model")) == "model+lookup"
    assert DrafterSpec.parse("recycling+lookup").plus("datastore").names == ("recycling", "lookup", "datastore")
    assert DrafterSpec.parse("lookup+model") == "model+lookup" != DrafterSpec.parse("model")  # equal to its text
    model_lookup, train_free, early = (DrafterSpec.parse(t) for t in ("model+lookup", "recycling+lookup", "early-exit"))
    assert model_lookup.uses_draft_model and not train_free.uses_draft_model and not early.uses_draft_model
    assert model_lookup.runs_network and early.runs_network and not train_free.runs_network
    assert early.drafts_on_target_cache and not model_lookup.drafts_on_target_cache
    assert SpecConfig(drafter="lookup+model").drafter == model_lookup  # parsed once, by the config
    for bad, message in [("lookahead", "unknown draft source 'lookahead'"), ("model+model", "names a source twice"),
                         ("", "drafter must name draft sources"), (3, "drafter must name draft sources")]:
        with pytest.raises(ValueError, match=message):
            SpecConfig(drafter=bad)


def test_recycling_template_is_the_papers_80_nodes():
    from opttree.settings.config import SpecConfig
    from opttree.step.policies import make_policy

    policy = make_policy(SpecConfig(tree="recycling-template", budget=80))
    depths = [len(p) for p in policy.paths]
    assert [depths.count(d) for d in range(1, 7)] == [8, 21, 25, 15, 8, 3]
    assert len(make_policy(SpecConfig(tree="recycling-template", budget=16)).paths) == 16


def test_lookup_rates_learn_from_verification(looping_pair):
    target, _ = looping_pair
    forget(target)
    source = LookupSource(target)
    before = source.rates.mean.copy()
    prompt = torch.randint(3, 48, (1, 6), generator=torch.Generator().manual_seed(2))
    opttree.generate(target, prompt, drafter="lookup", max_new_tokens=40, eos_token_id=[])
    assert not (per_model(target, "lookup-rates", lambda: None).mean == before).all()



# ---- the datastore (REST-style retrieval from files) ----


@pytest.fixture(scope="module")
def shipped_store(tmp_path_factory):
    """A datastore from two files: one holds the shipped target's own greedy continuation of PROMPT."""
    from opttree.step.drafters.datastore import build_datastore

    target, _, tok = opttree.demo_models(dtype=torch.float32)
    ids = tok(STORE_PROMPT, return_tensors="pt").input_ids
    continuation = hf_greedy(target, ids, 40, eos_token_id=None)
    folder = tmp_path_factory.mktemp("store")
    (folder / "a.txt").write_text("def unrelated():\n    return 42\n")
    (folder / "b.txt").write_text(tok.decode(continuation[0]))
    meta = build_datastore([folder / "a.txt", folder / "b.txt"], tok, folder / "store", progress=False)
    return target, tok, ids, continuation, folder / "store", meta


STORE_PROMPT = "def is_palindrome(text):\n"


def test_datastore_matches_agree_with_a_scan(shipped_store):
    from opttree.step.drafters.datastore import open_datastore

    *_, folder, meta = shipped_store
    store = open_datastore(folder)
    tokens = [int(t) for t in store.tokens]
    assert meta["tokens"] == len(tokens) and meta["max_n"] == 4  # 13-bit ids: 4 fit in one exact key
    rng = random.Random(0)
    for _ in range(30):
        start = rng.randrange(len(tokens) - 3)
        suffix = [rng.randrange(8192)] + tokens[start : start + rng.randrange(1, 4)]  # a known tail, a random head
        n, starts = store.matches(suffix, limit=3)
        for length in range(min(4, len(suffix)), 0, -1):  # brute force: the longest suffix present
            tail = suffix[-length:]
            found = [s + length for s in range(len(tokens) - length) if tokens[s : s + length] == tail]
            if found:
                assert (n, starts) == (length, found[-3:])
                break


def test_generation_with_a_datastore_is_exact_and_retrieves(shipped_store):
    target, tok, ids, continuation, folder, _ = shipped_store
    out = opttree.generate(target, ids, drafter="datastore", datastore=str(folder), max_new_tokens=40, eos_token_id=[])
    assert torch.equal(out.sequences, continuation)
    assert out.stats.mean_accepted_length > 4  # the store holds this very text
    out = opttree.generate(target, ids, datastore=str(folder), max_new_tokens=40, eos_token_id=[])  # default + datastore
    assert torch.equal(out.sequences, continuation)


def test_datastore_errors(shipped_store, tmp_path):
    target, tok, ids, _, folder, _ = shipped_store
    with pytest.raises(ValueError, match="does not use it: add 'datastore'"):
        opttree.generate(target, ids, drafter="lookup", datastore=str(folder), max_new_tokens=4)
    with pytest.raises(ValueError, match="needs a datastore folder"):
        opttree.generate(target, ids, drafter="datastore", max_new_tokens=4)
    with pytest.raises(ValueError, match="not a datastore"):
        opttree.generate(target, ids, drafter="datastore", datastore=str(tmp_path), max_new_tokens=4)


def test_datastore_command(shipped_store, tmp_path, capsys):
    from opttree.cli import main

    *_, folder, _ = shipped_store
    text = tmp_path / "doc.txt"
    text.write_text("print('hello')\n" * 3)
    assert main(["datastore", "build", str(text), "--out", str(tmp_path / "s")]) == 0
    assert "--datastore" in capsys.readouterr().out and (tmp_path / "s" / "datastore.json").exists()
    assert main(["generate", "--prompt", "print(", "--max-new-tokens", "6", "--datastore", str(tmp_path / "s"),
                 "--drafter", "lookup+datastore", "--dtype", "float32", "--json"]) == 0
    assert '"drafter": "lookup+datastore"' in capsys.readouterr().out
    assert main(["datastore", "build", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "t")]) == 2


def check_host_nodes(tree: DraftTree) -> None:
    """A tree made on the host carries its nodes as the tensors hold them (what `merge_best` reads instead)."""
    from dataclasses import replace

    from opttree.step.tree import _read

    assert tree.host_nodes is not None and list(tree.host_nodes) == _read(replace(tree, host_nodes=None))


@pytest.mark.parametrize("seed", range(6))
def test_a_cut_trie_is_the_same_from_continuations_cut_to_its_size(seed):
    """Retrieval asks for continuations no longer than the nodes it keeps (`RetrievalSource.propose`): the cut
    trie of the shortened continuations is the full-length one's, node for node (ties included)."""
    g = torch.Generator().manual_seed(seed)
    alphabet = 2 + seed % 3  # few tokens: shared prefixes and tied shares
    base = torch.randint(alphabet, (12,), generator=g).tolist()
    continuations = []  # copies of one text that part from it somewhere (deep chains), and random ones
    for i in range(8):
        own = torch.randint(alphabet, (int(torch.randint(1, 12, (), generator=g)),), generator=g).tolist()
        continuations.append(base[:int(torch.randint(4, 13, (), generator=g))] + own if i % 4 else own)
    log_rates = torch.rand(24, generator=g).clamp(min=0.05).log()
    for n in (1, 2, 3, 4, 7, 16):
        full, full_paths = continuation_trie(continuations, log_rates, n)
        cut, cut_paths = continuation_trie([c[:n] for c in continuations], log_rates, n)
        assert cut_paths == full_paths
        for field in ("tokens", "parents", "depths", "scores", "draft_slots"):
            assert torch.equal(getattr(cut, field), getattr(full, field)), field
        check_host_nodes(cut)


def test_recycling_rows_that_share_the_matrix_learn_from_a_step_together():
    """Rows of a batch share the recycling matrix: their drafters queue what they observed, and the first
    `learned` learns from every row's positions at once: hit rates scored against M as it was before the step,
    then M rewritten; later calls find nothing queued."""
    from opttree.step.drafters.recycling import RecyclingDrafter
    from opttree.step.verify import Verification

    class Target:  # the matrix is kept per target
        pass

    target, vocab, generator = Target(), 64, torch.Generator().manual_seed(3)
    rows = [RecyclingDrafter(target, vocab) for _ in range(3)]
    matrix = rows[0].matrix
    assert all(row.matrix is matrix for row in rows) and rows[0].learns_together
    matrix.write(torch.arange(vocab), torch.stack([torch.randperm(vocab, generator=generator)[:8] for _ in range(vocab)]))
    before_next, before_hits = matrix.next.clone(), matrix.rates.hits.clone()
    results = []
    for b, row in enumerate(rows):
        tree = DraftTree(torch.tensor([b + 10, b + 20]), torch.tensor([-1, 0]), torch.tensor([1, 2]), torch.zeros(2),
                         torch.full((2,), -1))
        logits = torch.randn(3, vocab, generator=generator)
        logits[0, before_next[b, 2]] = 20.0  # the target's choice after the root is M[root]'s rank 2
        result = Verification(torch.tensor(b), tree, logits, torch.arange(0), torch.tensor(0))
        row.observe(result)
        results.append((torch.tensor([b, b + 10, b + 20]), logits))
    assert torch.equal(matrix.next, before_next) and len(matrix.pending) == 3  # queued, not learned yet
    rows[1].learned()
    assert not matrix.pending
    for tokens, logits in results:
        assert torch.equal(matrix.next[tokens], logits.topk(8, dim=-1).indices)
    hits = matrix.rates.hits - before_hits  # (DEPTHS, k) hits counted this step
    assert hits[0, 2] == 3 and hits.sum() == sum(
        int((before_next[tokens] == logits.argmax(-1)[:, None]).sum()) for tokens, logits in results)
    rows[2].learned()  # nothing left to learn
    assert torch.equal(matrix.rates.hits - before_hits, hits)


def test_a_generation_leaves_nothing_unlearned():
    """The engine calls `learned` after every step: after a batch's greedy generation with Token Recycling, no step
    waits in the matrix's queue and every token each row read as a step's root has its row written."""
    target, _, tok = opttree.demo_models(dtype=torch.float32)
    prompts = ["def add(a, b):", "Once upon a time"]
    outs = opttree.generate(target, [tok(p, return_tensors="pt").input_ids[0] for p in prompts], None,
                            tree="opt", drafter="recycling", budget=8, max_new_tokens=24)
    from opttree.step.drafters.recycling import RecyclingDrafter

    matrix = RecyclingDrafter(target, target.config.vocab_size).matrix
    assert not matrix.pending
    for out, prompt in zip(outs, prompts):
        roots = out.sequences[0, len(tok(prompt).input_ids) - 1:-1]
        assert bool(matrix.filled[roots].all())


@pytest.mark.parametrize("seed", range(4))
def test_rows_listed_together_build_each_rows_own_tree(seed):
    """A batch's rows over one recycling matrix grow their OPT-Trees together (`policies.rows`): the same trees,
    bit for bit, as each row's own build, for rows of several budgets and deltas, depth limits that stop some rows
    early, rows whose delta stops them at different depths, and rows whose policy merges a lookup trie in."""
    from opttree.step.drafters.recycling import RecyclingDrafter
    from opttree.step.drafters.sources import MergedPolicy, Sources
    from opttree.step.policies.opt import OptTree
    from opttree.step.policies.rows import build_listed, listed_groups

    generator = torch.Generator().manual_seed(seed)
    vocab = 48

    class Target:  # the matrix is kept per target
        pass

    target = Target()
    matrix = RecyclingDrafter(target, vocab).matrix
    matrix.write(torch.arange(vocab), torch.stack([torch.randperm(vocab, generator=generator)[:8]
                                                   for _ in range(vocab)]))
    matrix.filled[torch.randperm(vocab, generator=generator)[:vocab // 4]] = False  # some rows never written
    matrix.rates.update((torch.arange(8).repeat_interleave(8), torch.arange(8).repeat(8)),
                        torch.rand(64, generator=generator) < 0.5)
    matrix.rates.hits += torch.rand(8, 8, generator=generator)  # distinct rates: no two candidates tie
    builds = []
    for i in range(30):
        budget, delta = [(4, 0.1), (8, 0.02), (4, 0.1), (16, 0.05), (4, 0.1), (3, 0.3), (2, 0.2), (8, 0.0)][i % 8]
        max_depth = int(torch.randint(1, 12, (), generator=generator))
        policy = OptTree(SpecConfig(budget=budget, delta=delta, max_depth=max_depth))
        committed = torch.randint(0, vocab, (6,), generator=generator)
        if i % 3:
            drafter = RecyclingDrafter(target, vocab)
        else:  # a lookup trie merged in: the prompt repeats, so retrieval finds continuations
            lookup = LookupSource(target)
            drafter = Sources(RecyclingDrafter(target, vocab), [lookup])
            committed = torch.cat([committed, committed, committed[:3]])
            drafter.start(committed)
            policy = MergedPolicy(policy, budget, policy.max_depth, prune=False)
        builds.append((policy, drafter, committed, int(torch.randint(1, 10, (), generator=generator))))
    groups = listed_groups(builds)
    assert sorted(len(group) for group in groups) == [3, 3, 4, 4, 4, 12]  # by budget and delta; every row in one
    stopped = 0  # rows whose delta stopped them before their depth limit
    for group in groups:
        together = build_listed([builds[i] for i in group])
        for i, tree in zip(group, together):
            policy, drafter, committed, limit = builds[i]
            own = policy.build(drafter, committed, limit)
            for field in ("tokens", "parents", "depths", "scores", "draft_slots"):
                assert torch.equal(getattr(tree, field), getattr(own, field)), (i, field)
            assert tree.host_parents == own.host_parents
            check_host_nodes(policy.policy.build(drafter, committed, limit) if isinstance(policy, MergedPolicy)
                             else tree)
            stopped += tree.max_depth < min(limit, policy.max_depth) and len(tree) == budget
    assert stopped >= 2
