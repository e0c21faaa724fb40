"""A batch's trees sized for its rows (`opttree.batch_sizing`): the latency table's interpolation, the
budget it picks, the per-step cut, and a batch without a budget drafting the sized one, exactly."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from arch_configs import tiny
from helpers import hf_greedy

import opttree
from opttree import batch_sizing
from opttree.batch_sizing import EXPLORE_EVERY, LARGER_BY, WIDTHS, BatchLatency, SizedBudget, expected_length
from opttree.profiles import AUTO_ENV
from opttree.step.tree import DraftTree, top_nodes


def table(per_row):
    """{rows: ms per width} from a function of (rows, width)."""
    return {rows: [float(per_row(rows, w)) for w in WIDTHS] for rows in (1, 2, 4)}


def test_the_latency_table_interpolates_between_measured_points_and_extrapolates_past_them():
    latency = BatchLatency(table(lambda rows, w: 10 * rows + w))
    assert latency.ms(2, 9) == 29  # a measured point
    assert latency.ms(2, 4) == pytest.approx(24)  # between widths 3 and 5
    assert latency.ms(3, 9) == pytest.approx(39)  # between 2 and 4 rows
    assert latency.ms(2, 66) == pytest.approx(2 * (20 + 33))  # past the widest: in proportion to the tokens
    assert latency.ms(8, 9) == pytest.approx(2 * 49)  # past the most rows: in proportion to the rows
    with pytest.raises(ValueError, match="positive ms"):
        BatchLatency({1: [1.0, 2.0]})


def brute_force(latency: BatchLatency, rows: int, cap: int) -> int:
    """The smallest budget (among the measured ones below cap, and cap) whose tokens per second no other
    beats by more than LARGER_BY."""
    budgets = [w - 1 for w in WIDTHS if 0 < w - 1 < cap] + [cap]
    rate = {n: rows * expected_length(n) / (latency.ms(rows, n + 1) / 1000) for n in budgets}
    top = max(rate.values())
    candidates = [n for n in budgets if rate[n] * (1 + LARGER_BY) >= top]
    return min(candidates)


@pytest.mark.parametrize("seed", range(5))
def test_the_sized_budget_is_the_one_with_the_most_tokens_per_second(seed):
    g = torch.Generator().manual_seed(seed)
    slope = torch.rand(3, generator=g).tolist()
    latency = BatchLatency(table(lambda rows, w: 5 + slope[0] * rows + slope[1] * rows * w + slope[2] * w * w))
    for rows in (2, 3, 4, 8):
        for cap in (1, 3, 8, 16, 40):
            assert latency.sized_budget(rows, cap) == brute_force(latency, rows, cap)
    assert latency.sized_budget(1, 16) == 16  # one sequence keeps its own budget


def test_free_tokens_keep_the_budget_and_tokens_paid_in_proportion_shrink_it_to_one_node():
    assert BatchLatency(table(lambda rows, w: 7.0)).sized_budget(8, 16) == 16
    assert BatchLatency(table(lambda rows, w: rows * w)).sized_budget(4, 16) == 1


def chain(tokens: list[int], sampled: bool = False) -> DraftTree:
    n = len(tokens)
    probs = torch.full((n + 1, 50), 1 / 50) if sampled else None
    return DraftTree(torch.tensor(tokens), torch.arange(n) - 1, torch.arange(1, n + 1),
                     -torch.arange(1.0, n + 1), torch.full((n,), -1), probs)


def test_the_cut_keeps_each_rows_best_nodes_and_leaves_sampled_trees_and_one_row_whole():
    """The cut after drafting: to the nodes chosen before it (`nodes`), for a tree that came out larger."""
    from opttree.stats import RowCost

    sized = SizedBudget(BatchLatency(table(lambda rows, w: rows * w)))  # 4 rows: 1 node each
    greedy, sampled = (RowCost(sized=True, sampled=hot, budget=3, tokens=None, draft_ms=None) for hot in (False, True))
    nodes = sized.nodes([greedy, greedy, sampled, greedy])
    assert nodes == [1, 1, None, 1]
    trees = [chain([5, 6, 7]), chain([8, 9]), chain([1, 2, 3], sampled=True), chain([])]
    cut = sized(trees, nodes)
    assert torch.equal(cut[0].tokens, top_nodes(trees[0], 1).tokens) and cut[0].tokens.tolist() == [5]
    assert cut[1].tokens.tolist() == [8]
    assert cut[2] is trees[2] and cut[3] is trees[3]
    assert sized([trees[0]], sized.nodes([greedy]))[0] is trees[0]  # one row: its own budget
    unsized = replace(greedy, sized=False)  # a row not sized (its budget given, or sampling) keeps its tree
    kept = sized(trees[:2], sized.nodes([greedy, unsized]))
    assert kept[0].tokens.tolist() == [5] and kept[1] is trees[1]


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """First-use measurement on (the test session turns it off), into an empty cache."""
    monkeypatch.setenv(AUTO_ENV, "1")
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(batch_sizing, "_MEASURED", {})
    return tmp_path


def test_a_batch_without_a_budget_drafts_the_budget_sized_for_it_and_stays_exact(measuring, capsys):
    target = tiny("llama", "sdpa", seed=1)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(3, 24, (size,), generator=g).remainder(7) + 3 for size in (5, 30, 12)]
    run = opttree.Speculator(target, drafter="recycling+lookup", max_new_tokens=16, eos_token_id=[])
    outs = run.stream([opttree.Request(ids) for ids in batch])
    latency = batch_sizing.batch_latency(target, 3)
    assert "timing this target's forward over batches of 1, 2, 4 rows" in capsys.readouterr().err
    stored = json.loads(batch_sizing.latency_path(target).read_text())
    assert stored["widths"] == list(WIDTHS) and sorted(map(int, stored["ms"])) == [1, 2, 4]
    assert {row.config.budget for row in outs.rows} == {latency.sized_budget(3, opttree.SpecConfig().budget)}
    for prompt, out in zip(batch, outs.finish()):
        assert torch.equal(out.sequences, hf_greedy(target, prompt[None], 16))
    batch_sizing._MEASURED.clear()  # another process: the table is read back, not timed again
    assert batch_sizing.batch_latency(target, 4).table == latency.table
    assert "timing" not in capsys.readouterr().err
    lookup = opttree.Speculator(target, drafter="lookup", max_new_tokens=16, eos_token_id=[])
    hot = opttree.Request(batch[0], temperature=0.8, seed=1)  # a sampled row keeps its budget: its draws its own
    mixed = lookup.stream([hot] + [opttree.Request(ids) for ids in batch[1:]])
    default = opttree.SpecConfig().budget
    assert [row.config.budget for row in mixed.rows] == [default] + [latency.sized_budget(3, default)] * 2
    assert [row.sized for row in mixed.rows] == [False, True, True]  # and the batch's cut passes it by
    assert torch.equal(mixed.finish()[0].sequences, lookup.generate(hot).sequences)
    given = opttree.Speculator(target, drafter="recycling+lookup", budget=16, max_new_tokens=16)
    given = given.stream([opttree.Request(i) for i in batch])
    assert {row.config.budget for row in given.rows} == {16} and not any(row.sized for row in given.rows)
    asked = opttree.Speculator(target, drafter="recycling+lookup", budget=16, max_new_tokens=16, batch_budget="sized")
    assert {row.config.budget for row in asked.stream([opttree.Request(i) for i in batch]).rows} == \
        {latency.sized_budget(3, 16)}


def test_without_first_use_measurement_a_batch_keeps_the_budget(monkeypatch, tmp_path):
    monkeypatch.setenv(AUTO_ENV, "0")
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(batch_sizing, "_MEASURED", {})
    target = tiny("llama", "sdpa", seed=1)
    run = opttree.Speculator(target, drafter="lookup", max_new_tokens=16)
    run = run.stream([opttree.Request(torch.arange(3, 9))] * 2)
    assert {row.config.budget for row in run.rows} == {opttree.SpecConfig().budget}
    assert not batch_sizing.latency_path(target).exists()  # nothing timed (the packed kernels' checks may be kept)
    with pytest.raises(TypeError, match="'sized' or 'rows'"):
        opttree.Speculator(target, batch_budget="auto")


def _rate(latency: BatchLatency, sized: SizedBudget, costs, plain: set[int]) -> float:
    """Brute force: the batch's tokens per ms when the rows in `plain` decode plainly."""
    drafting = [c for i, c in enumerate(costs) if i not in plain]
    width = max([c.budget if c.sampled or not c.sized else min(c.budget, latency.sized_budget(len(costs), c.budget))
                 for c in drafting], default=0)
    return (sum(c.tokens for c in drafting) + len(plain)) / (sum(c.draft_ms for c in drafting)
                                                             + latency.ms(len(costs), width + 1))


@pytest.mark.parametrize("seed", range(30))
def test_sampled_rows_decode_plainly_exactly_when_the_batch_is_faster_so(seed):
    """Brute force: all the sampled sized rows or none, whichever gives more tokens per ms (by LARGER_BY),
    and none once one of them has decoded plainly EXPLORE_EVERY steps in a row (they are measured again)."""
    from opttree.stats import RowCost

    g = torch.Generator().manual_seed(seed)
    slope = torch.rand(3, generator=g).tolist()
    latency = BatchLatency(table(lambda rows, w: 5 + 3 * slope[0] * rows + slope[1] * rows * w))
    sized = SizedBudget(latency)
    costs = [RowCost(sized=bool(torch.rand(1, generator=g) < 0.7), sampled=bool(torch.rand(1, generator=g) < 0.6),
                     budget=int(torch.randint(2, 17, (1,), generator=g)), tokens=1 + 3 * float(torch.rand(1, generator=g)),
                     draft_ms=8 * float(torch.rand(1, generator=g)),
                     plain_run=int(torch.randint(0, EXPLORE_EVERY + 2, (1,), generator=g)))
             for _ in range(int(torch.randint(2, 6, (1,), generator=g)))]
    chosen = {i for i, c in enumerate(costs) if c.sized and c.sampled}
    faster = bool(chosen) and _rate(latency, sized, costs, chosen) > _rate(latency, sized, costs, set()) * (1 + LARGER_BY)
    exploring = bool(chosen) and max(costs[i].plain_run for i in chosen) >= EXPLORE_EVERY
    expected = sorted(chosen) if faster and not exploring else []
    assert sized.plain(costs) == expected


def test_costly_sampled_trees_decode_plainly_under_load_and_not_before_one_of_them_drafted():
    from opttree.stats import RowCost

    sized = SizedBudget(BatchLatency(table(lambda rows, w: 4 + rows * (1 + 0.1 * w))))
    costly = RowCost(sized=True, sampled=True, budget=8, tokens=2.1, draft_ms=3.0)
    assert sized.plain([costly] * 8) == list(range(8))  # 8 rows: 24 ms of drafting for 9 tokens more
    assert sized.plain([costly]) == []  # alone, the tree pays (and a single row is never sized)
    new = RowCost(True, True, 8, None, None)  # a row that has not drafted yet: like the others of its kind
    assert sized.plain([costly] * 7 + [new]) == list(range(8))
    assert sized.plain([new] * 8) == [] and sized.plain([RowCost(True, False, 8, 2.0, 0.1)] + [new] * 7) == []
    cheap = RowCost(sized=True, sampled=True, budget=8, tokens=4.0, draft_ms=0.2)
    assert sized.plain([cheap] * 8) == []
    assert sized.plain([RowCost(sized=False, sampled=True, budget=8, tokens=2.1, draft_ms=3.0)] * 8) == []
    greedy = RowCost(sized=True, sampled=False, budget=8, tokens=5.0, draft_ms=0.5)  # greedy rows keep their trees
    assert sized.plain([greedy] * 4 + [costly] * 4) == [4, 5, 6, 7]
    assert sized.plain([replace(costly, plain_run=EXPLORE_EVERY)] + [costly] * 7) == []  # all draft: measured again


def test_a_sampled_row_without_a_seed_to_keep_may_decode_plainly_and_stays_exact():
    """`Speculator.row(request, reproducible=False)`: a sampled row a sized batch may let decode plainly
    (here on every step, by an allocator that always would): it drafts nothing and samples what plain
    decoding samples from its seed; a greedy row beside it stays the target's greedy output, and a sampled
    row that keeps its seed's draws (the default) is never sized."""
    from opttree.engine import Generation

    class AlwaysPlain(SizedBudget):
        def plain(self, costs):
            return [i for i, cost in enumerate(costs) if cost.sized and cost.sampled]

    target, draft = tiny("llama", "sdpa", seed=1), tiny("llama", "sdpa", seed=2)
    allocator = AlwaysPlain(BatchLatency(table(lambda rows, w: rows * w)))
    spec = opttree.Speculator(target, draft, budget=4, max_new_tokens=12, eos_token_id=[], batch_budget=allocator)
    g = torch.Generator().manual_seed(0)
    greedy, hot, kept = [torch.randint(3, 24, (n,), generator=g) for n in (6, 9, 7)]
    rows = [spec.row(opttree.Request(greedy)), spec.row(opttree.Request(hot, temperature=1.0, seed=5), reproducible=False),
            spec.row(opttree.Request(kept, temperature=1.0, seed=6))]
    assert [row.sized for row in rows] == [True, True, False]
    for _ in Generation(target, rows, width=0, static=False, batch=True, allocator=allocator):
        pass
    assert torch.equal(rows[0].committed, hf_greedy(target, greedy[None], 12)[0])
    assert rows[1].stats.drafted_tokens == 0 and rows[1].stats.steps == 12
    plain = opttree.generate(target, hot[None], tree="ar", temperature=1.0, seed=5, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(rows[1].committed, plain.sequences[0])
    assert rows[2].stats.drafted_tokens > 0
    assert torch.equal(rows[2].committed, spec.generate(opttree.Request(kept, temperature=1.0, seed=6)).sequences[0])


@pytest.mark.parametrize("seed", range(10))
def test_before_drafting_greedy_sized_rows_get_the_batchs_size_plain_rows_none_the_rest_their_own(seed):
    from opttree.stats import RowCost

    g = torch.Generator().manual_seed(seed)
    latency = BatchLatency(table(lambda rows, w: 5 + rows * w * float(torch.rand(1, generator=g))))
    sized = SizedBudget(latency)
    costs = [RowCost(sized=bool(torch.rand(1, generator=g) < 0.7), sampled=bool(torch.rand(1, generator=g) < 0.4),
                     budget=int(torch.randint(1, 33, (1,), generator=g)), tokens=2.0, draft_ms=1.0)
             for _ in range(int(torch.randint(2, 9, (1,), generator=g)))]
    greedy = [c.budget for c in costs if c.sized and not c.sampled]
    size = latency.sized_budget(len(costs), max(greedy)) if greedy else None
    plain = set(sized.plain(costs))
    assert sized.nodes(costs) == [0 if i in plain else min(c.budget, size) if c.sized and not c.sampled else None
                                  for i, c in enumerate(costs)]
    assert all(costs[i].sampled and costs[i].sized for i in plain)
    assert sized.nodes(costs[:1]) == [None]  # one row: its own budget


@pytest.mark.parametrize("tree, drafter", [("opt", "model"), ("opt", "recycling+lookup"), ("eagle2", "model"),
                                           ("dyspec", "model"), ("sequoia", "model"), ("eagle2", "lookup"),
                                           ("opt", "head+lookup")])
def test_a_sized_greedy_row_drafts_at_the_batchs_size_rather_than_cutting_and_stays_exact(tree, drafter, tmp_path):
    """Rows of budget 8 in a batch sized below that: each drafts with its policy built for the batch's size (so
    no tree comes to the cut larger than it), and each text is the target's greedy one."""
    from opttree.engine import Generation

    drafted: list[int] = []

    class Recording(SizedBudget):
        def __call__(self, trees, nodes):
            drafted.extend(len(tree) for tree in trees)
            return super().__call__(trees, nodes)

    allocator = Recording(BatchLatency(table(lambda rows, w: 30 + rows * w)))
    size = allocator.latency.sized_budget(3, 8)
    assert 1 < size < 8
    target = tiny("llama", "sdpa", seed=1)
    draft = tiny("llama", "sdpa", seed=2) if drafter == "model" else None
    head = {}
    if "head" in drafter:
        from opttree.step.drafters.head import FeatureHead, head_config

        torch.manual_seed(0)
        head = dict(head=FeatureHead(head_config(target)).save(tmp_path / "head", target))
    spec = opttree.Speculator(target, draft, tree=tree, drafter=drafter, budget=8, max_new_tokens=12,
                              eos_token_id=[], batch_budget=allocator, **head)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 24, (n,), generator=g).remainder(5) + 3 for n in (6, 9, 7)]
    rows = [spec.row(opttree.Request(ids)) for ids in prompts]
    for _ in Generation(target, rows, width=0, static=False, batch=True, allocator=allocator):
        pass
    for row, ids in zip(rows, prompts):
        assert torch.equal(row.committed, hf_greedy(target, ids[None], 12)[0])
        assert row.config.budget == 8 and size in row.resized  # its own budget kept, its policy built smaller
    assert drafted and max(drafted) <= size and max(drafted) > 1  # drafted at the size, not cut to it
