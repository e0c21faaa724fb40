"""A batch's trees sized for its rows (docs/USAGE.md, "Batches and requests").

B sequences verified in one forward pay for B trees: past a few rows the forward's cost grows with the
batch's tokens, so the tree that is best for one sequence alone is too large for each of B rows (on a
2-core bf16 CPU, 8 rows of 17 tokens took 1.6x as long as 8 rows of 2; one row, 1.1x). `BatchLatency`
holds this machine's measured cost of a forward over `rows` sequences of `tokens` new tokens each (timed
once per target and machine, kept in the user cache); `sized_budget` picks the per-row budget n that makes the batch's
tokens per second largest, B * E(n) / T(B, n + 1), with the expected accepted length per step
E(n) = 1 + ACCEPTED_PER_DOUBLING * log2(1 + n), at most the one-sequence budget.
`SizedBudget` has each row draft its tree at that size for the rows running at each step (continuous batching)
where its policy can be built for fewer nodes, and cuts the trees drafted larger;
sampled trees are never cut (their nodes are draws for their budget), and a sampled row is sized only when
it asks no seed to reproduce (`Speculator.row`): it then decodes plainly on the steps where that makes the
batch faster (`SizedBudget.plain`: its drafting costs more than its tokens bring).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from .device import model_device, synchronize
from .hardware import hardware_key, now
from .packed import packed_models
from .profiles import AUTO_ENV, model_part, profile_dir
from .stats import RowCost
from .step.cache import cache_argument, context_window, new_cache, truncate
from .step.tree import DraftTree, splittable, top_nodes
from .step.verify import verify_trees

WIDTHS = (1, 2, 3, 5, 9, 17, 33)  # tokens per row timed: the root and 0, 1, 2, 4, 8, 16, 32 draft nodes
CONTEXT = 256  # tokens cached per row while timing (a prompt and some output)
REPEATS = 5  # timings per point (their median), after one warm-up
# A larger tree must promise this much more than a smaller one: within the timings' noise the smaller
# tree wins, as it also drafts less (host work that T leaves out). Timed twice on one machine, 4 rows' T(17) /
# T(9) came out 1.37 and 1.17: at E(16) / E(8) = 1.19 the choice flipped between 8 and 16 without it.
LARGER_BY = 0.03
# E(n) - 1 grows by this many tokens for each doubling of n + 1: fitted to the mean accepted lengths measured
# at budgets 2-16 on the shipped pair (0.56-0.71 with the draft model, 0.71-0.84 with recycling+lookup).
ACCEPTED_PER_DOUBLING = 0.6
# After this many steps decoded plainly in a row, a batch's sampled rows draft once, so that their measured tokens
# and drafting time follow their text (sources warm up, text turns repetitive or not) and trees can come back.
EXPLORE_EVERY = 32


def expected_length(budget: int) -> float:
    """Tokens a step emits with `budget` draft nodes, as `sized_budget` models it (the bonus included)."""
    return 1 + ACCEPTED_PER_DOUBLING * math.log2(1 + budget)


class BatchLatency:
    """ms of one forward over `rows` sequences of `tokens` new tokens each, from a table measured at
    row counts 1, 2, 4, ... and the WIDTHS: linear between measured points; past the widest, in
    proportion to the tokens; past the most rows, in proportion to the rows."""

    def __init__(self, table: dict[int, list[float]], widths: tuple[int, ...] = WIDTHS):
        if not table or any(len(ms) != len(widths) or min(ms) <= 0 for ms in table.values()):
            raise ValueError("a batch latency table holds positive ms for every width at each row count")
        self.table, self.widths = {int(rows): list(ms) for rows, ms in table.items()}, tuple(widths)

    def ms(self, rows: int, tokens: int) -> float:
        counts = sorted(self.table)
        below = max([c for c in counts if c <= rows], default=counts[0])
        above = min([c for c in counts if c >= rows], default=counts[-1])
        low, high = self._at(below, tokens), self._at(above, tokens)
        if above == below:
            return low * (rows / below if rows > below else 1.0)
        return low + (high - low) * (rows - below) / (above - below)

    def _at(self, rows: int, tokens: int) -> float:
        ms, widths = self.table[rows], self.widths
        if tokens >= widths[-1]:
            return ms[-1] * tokens / widths[-1]
        i = next(i for i, w in enumerate(widths) if w >= tokens)
        if i == 0:
            return ms[0]
        return ms[i - 1] + (ms[i] - ms[i - 1]) * (tokens - widths[i - 1]) / (widths[i] - widths[i - 1])

    def sized_budget(self, rows: int, cap: int) -> int:
        """The per-row budget n that makes `rows` rows' tokens per second largest, among the measured
        widths' budgets below `cap` and `cap` itself (one row: cap): the smallest within LARGER_BY of the
        largest tokens per second."""
        if rows <= 1:
            return cap
        budgets = [w - 1 for w in self.widths if 1 <= w - 1 < cap] + [cap]
        rate = {n: expected_length(n) / self.ms(rows, n + 1) for n in budgets}  # tokens a ms, per row
        best = max(rate.values())
        return min(n for n in budgets if rate[n] * (1 + LARGER_BY) >= best)


class SizedBudget:
    """For `Generation`'s allocator: each greedy row's tree drafted at the budget sized for the rows of this step
    (`BatchLatency.sized_budget`, at most its own budget: `nodes`), and cut to it after drafting where it came out
    larger. Left whole: the trees of rows not `sized` (a budget given, or a seed to reproduce) and trees of sampled
    nodes (drawn for their own budget).
    Sampled rows that may be sized decode plainly on the steps where that makes the batch faster (`plain`)."""

    def __init__(self, latency: BatchLatency):
        self.latency = latency
        self.sizes: dict[tuple[int, int], int] = {}  # (rows, cap) -> budget

    def plain(self, costs: list[RowCost]) -> list[int]:
        """The sampled rows that may be sized, all of them or none, to decode plainly this step: all when the
        batch's tokens per second is larger so, from each row's measured tokens and drafting ms per drafting
        step and this machine's batch forward. A sampled tree cannot be cut (its nodes are draws for its
        budget), and under load its drafting, row after row, costs more than its tokens bring: 8 clients at
        temperature 1 on a 2-core CPU, trees of 8 sampled nodes gave 266 tokens/s, plain decoding 395. (Greedy
        rows keep their cut trees: this estimate, which counts a row's observing as drafting and the widest
        tree as the step's width, chose plain decoding for cheap greedy trees that measured 1.17x it.) A row
        not measured yet counts as the mean of the sampled rows that are (none is chosen while none is). Once
        one of them has decoded plainly EXPLORE_EVERY steps in a row, they all draft a step, to be measured again."""
        chosen = {i for i, cost in enumerate(costs) if cost.sized and cost.sampled}
        costs = _measured_or_like(costs) if len(costs) > 1 and chosen else None
        if costs is None:
            return []
        rows = len(costs)

        def width(cost: RowCost) -> int:  # nodes it verifies when it drafts
            return cost.budget if cost.sampled or not cost.sized else min(cost.budget, self._size(rows, cost.budget))

        def rate(plain: set[int]) -> float:  # tokens per ms of the step
            drafting = [cost for i, cost in enumerate(costs) if i not in plain]
            ms = sum(cost.draft_ms for cost in drafting) + self.latency.ms(rows, max(map(width, drafting), default=0) + 1)
            return (sum(cost.tokens for cost in drafting) + len(plain)) / ms

        if max(costs[i].plain_run for i in chosen) >= EXPLORE_EVERY or rate(chosen) <= rate(set()) * (1 + LARGER_BY):
            return []  # (all draft together, to be measured again: one drafting row widens every row's step)
        return sorted(chosen)

    def nodes(self, costs: list[RowCost]) -> list[int | None]:
        """Before drafting, each row's most nodes this step: 0 for the sampled rows that decode plainly (`plain`),
        the budget sized for the rows for each greedy row that may be sized (at most its own: drafting no more than
        the cut keeps saves its drafting, e.g. 4 nodes a row at 8 rows where a request's budget is 16), None for
        the others (their own budget)."""
        plain = set(self.plain(costs))
        greedy = [cost.budget for cost in costs if cost.sized and not cost.sampled]
        size = self._size(len(costs), max(greedy)) if len(costs) > 1 and greedy else None
        return [0 if i in plain else min(cost.budget, size) if size is not None and cost.sized and not cost.sampled
                else None for i, cost in enumerate(costs)]

    def _size(self, rows: int, cap: int) -> int:
        if (rows, cap) not in self.sizes:
            self.sizes[(rows, cap)] = self.latency.sized_budget(rows, cap)
        return self.sizes[(rows, cap)]

    def __call__(self, trees: list[DraftTree], nodes: list[int | None]) -> list[DraftTree]:
        """The trees cut to the nodes `nodes` chose before drafting, where one came out larger (a row whose policy
        could not be built for them); trees of sampled nodes stay whole (drawn for their own budget)."""
        cut = set(splittable(trees))
        return [top_nodes(tree, n) if i in cut and n is not None and len(tree) > n else tree
                for i, (tree, n) in enumerate(zip(trees, nodes))]


def _measured_or_like(costs: list[RowCost]) -> list[RowCost] | None:
    """Each row's cost, a row not measured yet given the mean of the measured rows of its kind (sampled or
    not; a greedy row with none: its budget's `expected_length` and no drafting time); None when a sampled
    row has none to go by."""
    filled = []
    for cost in costs:
        if cost.tokens is None:
            like = [c for c in costs if c.tokens is not None and c.sampled == cost.sampled]
            if not like and cost.sampled:
                return None
            tokens = statistics.fmean(c.tokens for c in like) if like else expected_length(cost.budget)
            cost = replace(cost, tokens=tokens, draft_ms=statistics.fmean(c.draft_ms for c in like) if like else 0.0)
        filled.append(cost)
    return filled


_MEASURED: dict[Path, BatchLatency] = {}  # this process's tables, by file


def batch_latency(target, rows: int) -> BatchLatency | None:
    """This machine's batch latency table for `target`, covering `rows` rows: read from the user cache, or
    timed now (once per target, machine and row count, with a message) and saved there. None when
    $OPTTREE_AUTO_CALIBRATE is 0 and no table covers `rows` (nothing is timed then)."""
    path = latency_path(target)
    table = _MEASURED.get(path)
    if table is None and path.exists():
        stored = json.loads(path.read_text())
        if tuple(stored.get("widths", ())) == WIDTHS:
            table = _MEASURED[path] = BatchLatency({int(r): ms for r, ms in stored["ms"].items()})
    wanted = [2**i for i in range(math.ceil(math.log2(max(rows, 1))) + 1)]  # 1, 2, 4, ... >= rows
    missing = [r for r in wanted if table is None or r not in table.table]
    if not missing:
        return table
    if os.environ.get(AUTO_ENV, "1") == "0":
        return table if table is not None and max(table.table) >= rows else None
    print(f"opttree: timing this target's forward over batches of {', '.join(map(str, missing))} rows on this "
          f"machine (once: kept in {path.parent})", file=sys.stderr)
    measured = dict(table.table) if table is not None else {}
    for count in missing:
        measured[count] = verify_ms(target, count)
    table = _MEASURED[path] = BatchLatency(measured)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"target": target.config._name_or_path, "hardware": hardware_key(target.device),
                                "date": now(), "context": timing_context(target), "widths": list(WIDTHS),
                                "ms": {str(r): ms for r, ms in sorted(measured.items())}}, indent=1) + "\n")
    return table


def latency_path(target) -> Path:
    """Where `target`'s batch latency table lives: keyed by its name, configuration, dtype and the hardware."""
    blob = json.dumps([model_part(target), hardware_key(target.device)], sort_keys=True, default=str)
    return profile_dir() / f"batch-{hashlib.sha256(blob.encode()).hexdigest()[:20]}.json"


def verify_ms(target, rows: int) -> list[float]:
    """Median ms of the engine's verify forward (`verify_trees`) over `rows` rows of CONTEXT cached tokens
    (fewer in a shorter context window), each with a tree of w - 1 nodes (a chain: every tree shape of
    w - 1 nodes costs the same), for w in WIDTHS."""
    device = model_device(target)
    vocab = target.get_input_embeddings().weight.shape[0]
    context = timing_context(target)
    ids = (torch.arange(context, device=device) * 7919 % vocab).expand(rows, -1)  # (rows, C) in-vocabulary
    times = []
    with torch.inference_mode(), packed_models(target):  # as a generation runs it
        cache = new_cache(target)
        target(input_ids=ids, **{cache_argument(target): cache})
        for width in WIDTHS:
            nodes = width - 1
            tree = DraftTree(tokens=ids[0, :nodes], parents=torch.arange(nodes, device=device) - 1,
                             depths=torch.arange(1, nodes + 1, device=device), scores=torch.zeros(nodes, device=device),
                             draft_slots=torch.full((nodes,), -1, device=device))
            samples = []
            for _ in range(REPEATS + 1):  # the first is a warm-up
                synchronize(device)
                start = time.perf_counter()
                verify_trees(target, cache, list(ids[:, -1]), [tree] * rows, [context] * rows)
                synchronize(device)
                samples.append(1000 * (time.perf_counter() - start))
                truncate(cache, context)
            times.append(statistics.median(samples[1:]))
    return times


def timing_context(target) -> int:
    """Tokens cached per row while timing: CONTEXT, fewer where the widest tree would pass the window."""
    window = context_window(target)
    return CONTEXT if window is None else max(1, min(CONTEXT, window - WIDTHS[-1]))


LANE_POSITIONS = 4096  # a batch's rows x its longest row: any mix of lengths up to this many positions in all ...
LANE_PADDING = 2.0  # ... or, past them, at most this many positions per real one


def fits(lengths: list[int]) -> bool:
    """Whether rows of these lengths (positions each holds) share a batch: a step's attention covers every row up
    to the longest, so a long prompt beside short ones would multiply the short ones' attention work (measured: one
    prompt of 1,606 tokens among 15 of 16-131 took 8 clients of `opttree serve` from ~630 to ~200 tokens/s, and a
    batch `generate` of the 16 to a quarter of their speed one at a time). Past LANE_POSITIONS padded positions
    (where attention starts to weigh against a step's reading of the weights), the padding is bounded."""
    return max(lengths) * len(lengths) <= max(LANE_POSITIONS, LANE_PADDING * sum(lengths))


def length_lanes(lengths: list[int]) -> list[list[int]]:
    """The indices of `lengths` in batches that `fits` (`by_length`)."""
    return by_length(lengths, fits)


def by_length(lengths: list[int], together) -> list[list[int]]:
    """The indices of `lengths` in groups: by length, shortest first, each group taking the next while
    together(the group's lengths with it) holds."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and together([lengths[j] for j in groups[-1]] + [lengths[i]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
