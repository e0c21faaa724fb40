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

from collections import defaultdict

import torch

from ...settings.declared import Declared
from ..tree import DraftTree, node_paths, paths_of, top_nodes
from .estimates import HitRates, per_model

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


def continuation_trie(continuations: list[list[int]], log_rates: torch.Tensor) -> DraftTree:
    """The trie of `continuations` (token lists, one per match), scored log(share of the matches
    through the node) + log_rates[:d].sum() for a node at depth d."""
    counts: dict[tuple[int, ...], int] = defaultdict(int)
    for continuation in continuations:
        for d in range(1, len(continuation) + 1):
            counts[tuple(continuation[:d])] += 1
    paths = sorted(counts, key=lambda p: (len(p), -counts[p], p))  # parents first
    if not paths:
        return DraftTree.empty()
    index = {p: i for i, p in enumerate(paths)}
    cumulative = torch.cumsum(log_rates, 0)
    share = torch.tensor([counts[p] / len(continuations) for p in paths])
    return DraftTree(
        tokens=torch.tensor([p[-1] for p in paths]),
        parents=torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths]),
        depths=torch.tensor([len(p) for p in paths]),
        scores=share.log() + cumulative[torch.tensor([len(p) - 1 for p in paths])],
        draft_slots=torch.full((len(paths),), -1, dtype=torch.long),
    )


class RetrievalSource(Declared):
    """Candidates copied from what followed earlier occurrences of the committed text's longest
    matching suffix; subclasses say where they look (`retrieve`). Hit rates per (match length, depth)
    are learned from every verification and kept per target under `rates_key`."""

    rates_key = "retrieval-rates"

    def __init__(self, target):
        prior = 0.6 * torch.ones(MAX_NGRAM, DEPTHS)  # P(hit | match length, depth), before any step
        self.rates = per_model(target, self.rates_key, lambda: HitRates((MAX_NGRAM, DEPTHS), prior))
        self.proposed: tuple[int, list[tuple[int, ...]]] | None = None  # (match length, node paths)

    def start(self, input_ids: torch.Tensor) -> None:
        pass

    def retrieve(self, committed: torch.Tensor, depth: int) -> tuple[int, list[list[int]]]:
        """(n, continuations up to `depth` tokens) for the longest suffix of n tokens found; (0, []) if none."""
        raise NotImplementedError

    def propose(self, committed: torch.Tensor, max_nodes: int, max_depth: int) -> DraftTree:
        n, continuations = self.retrieve(committed, max_depth)
        self.proposed = None
        if n == 0:
            return DraftTree.empty(committed.device)
        rows = torch.arange(max_depth).clamp(max=DEPTHS - 1)  # depths past DEPTHS share the last rate (as in observe)
        log_rates = self.rates.mean[n - 1, rows].log()  # (max_depth,)
        trie = top_nodes(continuation_trie(continuations, log_rates), max_nodes)
        self.proposed = (n, node_paths(trie))
        return trie.to(committed.device)

    def observe(self, result) -> None:
        """Per (match length, depth): was a proposed node the target's choice after its parent? Known for
        every proposed node that was verified (the target's choice at its parent), and for the others
        whose parent is on the accepted path (the accepted tokens + bonus are the target's choices), so
        a source whose nodes lost the budget still learns."""
        if self.proposed is None:
            return
        n, paths = self.proposed
        tree, emitted = result.tree, result.readout.emitted  # accepted tokens + bonus, as the host read them
        size = len(tree)
        read = torch.cat([result.choice, tree.tokens, tree.parents]).tolist()  # one read
        choice, tokens, parents = read[: size + 1], read[size + 1 : 2 * size + 1], read[2 * size + 1 :]
        index = {path: i for i, path in enumerate(paths_of(tokens, parents))}
        found = [index.get(tuple(path), -1) for path in paths]
        depths, hits = [], []
        for path, node in zip(paths, found):
            d = len(path)
            if node >= 0:
                hit = choice[parents[node] + 1] == tokens[node]
            elif list(path[:-1]) == emitted[: d - 1] and d <= len(emitted):
                hit = path[-1] == emitted[d - 1]
            else:
                continue
            depths.append(min(d, DEPTHS) - 1)
            hits.append(hit)
        if hits:
            self.rates.update((torch.full((len(hits),), n - 1), torch.tensor(depths)), torch.tensor(hits))


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

    def retrieve(self, committed: torch.Tensor, depth: int) -> tuple[int, list[list[int]]]:
        n, starts = self.store.matches(committed[-MAX_NGRAM:].tolist(), MATCHES)
        return n, [self.store.continuation(s, depth) for s in starts]
