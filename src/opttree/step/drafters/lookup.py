"""Retrieval from the text so far (prompt lookup, REST-style; docs/METHODS.md, "Draft sources").

`NgramIndex` remembers where every 1..m-gram of the committed tokens (prompt and output) ended. At a
step, the longest suffix of the committed tokens that occurred before gives up to `MATCHES` earlier
places (the latest ones); what followed each forms a trie of continuations (`continuation_trie`).
A node's score is log(its share of the matches) + the cumulative log of the online hit rate at its
depth for matches of that length: a calibrated estimate of its acceptance, so a policy can weigh it
against another source's nodes. `LookupSource` is the candidate source; it needs no model.
`DatastoreSource` retrieves the same way from a datastore built from files (`drafters.datastore`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from itertools import accumulate

import numpy
import torch

from ...settings.declared import Declared
from ..tree import DraftTree
from .estimates import HostHitRates, per_model

MAX_NGRAM = 4  # suffixes of 1..MAX_NGRAM tokens are looked up, the longest first
MATCHES = 8  # the latest matches of the longest suffix found make the trie
DEPTHS = 16  # hit rates per depth up to this one


class NgramIndex:
    """Where each n-gram (n <= max_n) of a growing token sequence ended; extended incrementally."""

    def __init__(self, max_n: int = MAX_NGRAM):
        self.max_n = max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = defaultdict(list)  # n-gram -> positions just after it

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(1, min(self.max_n, end) + 1):
                self.ends[tuple(self.tokens[end - n : end])].append(end)

    def matches(self, limit: int = MATCHES) -> tuple[int, list[int]]:
        """(n, starts): the longest suffix of n tokens seen before, and the positions that followed its
        latest `limit` earlier occurrences (oldest first). (0, []) when even the last token is new."""
        end = len(self.tokens)
        for n in range(min(self.max_n, end), 0, -1):
            starts = self.ends.get(tuple(self.tokens[end - n :]), [])
            earlier = [s for s in starts[-limit - 1 :] if s < end][-limit:]
            if earlier:
                return n, earlier
        return 0, []


def continuation_trie(continuations: list[list[int]], log_rates, max_nodes: int | None = None
                      ) -> tuple[DraftTree, list[tuple[int, ...]]]:
    """The trie of `continuations` (token lists, one per match), scored log(share of the matches
    through the node) + log_rates[:d].sum() for a node at depth d, cut to its best `max_nodes` nodes (a
    node counts at the lowest score on its path; ties to the shallower, then the more shared node: a node's
    ancestors come before it, so a cut trie holds no node deeper than `max_nodes`), and the token path of each
    of its nodes. Built on the host from host data: nothing is read from a device."""
    counts: dict[tuple[int, ...], int] = defaultdict(int)
    for continuation in continuations:
        for d in range(1, len(continuation) + 1):
            counts[tuple(continuation[:d])] += 1
    paths = sorted(counts, key=lambda p: (len(p), -counts[p], p))  # parents first
    cumulative = list(accumulate(float(rate) for rate in log_rates))
    scores, path_min = {}, {}
    for path in paths:
        scores[path] = math.log(counts[path] / len(continuations)) + cumulative[len(path) - 1]
        path_min[path] = min(scores[path], path_min.get(path[:-1], math.inf))
    if max_nodes is not None:
        best = set(sorted(range(len(paths)), key=lambda i: (-path_min[paths[i]], i))[:max_nodes])
        paths = [path for i, path in enumerate(paths) if i in best]  # a kept node's parent is kept
    if not paths:
        return DraftTree.empty(), []
    index = {p: i for i, p in enumerate(paths)}
    columns = [[p[-1] for p in paths], [index[p[:-1]] if len(p) > 1 else -1 for p in paths], [len(p) for p in paths],
               [-1] * len(paths)]  # tokens, parents, depths, slots
    tokens, parents, depths, slots = torch.tensor(columns).unbind()
    rounded = numpy.array([scores[p] for p in paths], dtype=numpy.float32)  # the scores as the tensor holds them
    nodes = tuple(zip(columns[0], columns[1], columns[2], rounded.tolist(), columns[3]))
    return DraftTree(tokens, parents, depths, torch.from_numpy(rounded), slots, host_nodes=nodes), paths


class RetrievalSource(Declared):
    """Candidates copied from what followed earlier occurrences of the committed text's longest
    matching suffix; subclasses say where they look (`retrieve`). Hit rates per (match length, depth)
    are learned from every verification and kept per target under `rates_key`. The index, the rates and
    the proposals live on the host: a step sends the trie to the device and reads nothing back (the
    accepted tokens come with the step's one read)."""

    rates_key = "retrieval-rates"

    def __init__(self, target):
        # P(hit | match length, depth), before any step
        self.rates = per_model(target, self.rates_key, lambda: HostHitRates((MAX_NGRAM, DEPTHS), 0.6))
        self.proposed: tuple[int, list[tuple[int, ...]]] | None = None  # (match length, node paths)

    def start(self, input_ids: torch.Tensor) -> None:
        pass

    def retrieve(self, committed: torch.Tensor, depth: int) -> tuple[int, list[list[int]]]:
        """(n, continuations up to `depth` tokens) for the longest suffix of n tokens found; (0, []) if none."""
        raise NotImplementedError

    def propose(self, committed: torch.Tensor, max_nodes: int, max_depth: int) -> DraftTree:
        # a node of the cut trie has its ancestors before it (`continuation_trie`): none is deeper than max_nodes
        n, continuations = self.retrieve(committed, min(max_depth, max_nodes))
        self.proposed = None
        if n == 0:
            return DraftTree.empty(committed.device)
        rows = [min(d, DEPTHS - 1) for d in range(max_depth)]  # depths past DEPTHS share the last rate (as in observe)
        trie, paths = continuation_trie(continuations, numpy.log(self.rates.mean[n - 1, rows]), max_nodes)
        self.proposed = (n, paths)
        return trie.to(committed.device)

    def observe(self, result) -> None:
        """Per (match length, depth): was a proposed node the target's choice after its parent, for every
        proposed node whose parent the step reached (the root or an accepted node): there the target's choice
        is the next token the step emitted (accepted tokens + bonus). That is the rate a node's score needs:
        the chance it is accepted once its parent is. Known on the host, whether the node was verified or lost
        the budget to another source's."""
        if self.proposed is None:
            return
        n, paths = self.proposed
        emitted = result.readout.emitted  # accepted tokens + bonus, as the host read them
        depths, hits = [], []
        for path in paths:
            d = len(path)
            if d <= len(emitted) and list(path[:-1]) == emitted[: d - 1]:
                depths.append(min(d, DEPTHS) - 1)
                hits.append(path[-1] == emitted[d - 1])
        if hits:
            self.rates.update(([n - 1] * len(hits), depths), hits)


class LookupSource(RetrievalSource):
    """Retrieval from the prompt and the output so far (prompt lookup decoding, several matches)."""

    rates_key = "lookup-rates"

    def start(self, input_ids: torch.Tensor) -> None:
        self.index = NgramIndex()
        self.index.extend(input_ids.tolist())

    def retrieve(self, committed: torch.Tensor, depth: int) -> tuple[int, list[list[int]]]:
        if committed.shape[0] > len(self.index.tokens):  # tokens not heard of in `observe` (none in the engine)
            self.index.extend(committed[len(self.index.tokens) :].tolist())
        n, starts = self.index.matches()
        return n, [self.index.tokens[s : s + depth] for s in starts]

    def observe(self, result) -> None:
        super().observe(result)
        self.index.extend(result.readout.emitted)  # the step's tokens, read once by the engine


class DatastoreSource(RetrievalSource):
    """Retrieval from a datastore built once from files (`opttree datastore build`), REST-style."""

    rates_key = "datastore-rates"

    def __init__(self, target, datastore):
        super().__init__(target)
        self.store = datastore
        self.recent: list[int] = []  # the committed text's last MAX_NGRAM tokens, on the host

    def start(self, input_ids: torch.Tensor) -> None:
        self.recent = input_ids[-MAX_NGRAM:].tolist()

    def retrieve(self, committed: torch.Tensor, depth: int) -> tuple[int, list[list[int]]]:
        n, starts = self.store.matches(self.recent, MATCHES)
        return n, [self.store.continuation(s, depth) for s in starts]

    def observe(self, result) -> None:
        super().observe(result)
        self.recent = (self.recent + result.readout.emitted)[-MAX_NGRAM:]
