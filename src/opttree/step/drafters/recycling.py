"""Token Recycling (Luo et al. 2024; docs/METHODS.md, "Draft sources"): the target's own top-k guesses, recycled.

`RecyclingMatrix` M (V, k): M[t] holds the target's k most likely next tokens the last time it read
token t, rewritten from every verified position of every step (accepted or not; last write wins),
seeded from the prompt's prefill and kept across generations with the same target (hot start).
Drafting needs no forward pass: `RecyclingDrafter` answers a tree policy's distribution queries
from M, giving rank r of a row the online estimate of how often rank r was the target's choice at
that depth (so OPT-Tree can weigh recycled candidates like a draft model's); the rest of the mass is
spread evenly. The authors' own tree is the `recycling-template` policy (80 nodes, 6 levels).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...device import on
from ...settings.declared import Declared
from .estimates import HitRates, per_model

WIDTH = 8  # k: successors kept per token, as in the paper
DEPTHS = 8  # hit rates are kept per depth up to this one (deeper nodes share the last)
MAX_LISTED_MASS = 0.95  # a row never claims more than this for its k listed tokens
PROMPT_ROWS = 256  # the prompt's last positions whose logits seed the matrix (cold start)


class RecyclingMatrix:
    def __init__(self, vocab: int, device: torch.device | str = "cpu", width: int = WIDTH):
        self.vocab, self.width = vocab, min(width, vocab)
        self.next = torch.zeros(vocab, self.width, dtype=torch.long, device=device)  # (V, k) M (long: read as indices)
        self.filled = torch.zeros(vocab, dtype=torch.bool, device=device)  # (V,) rows written at least once
        self.ranks = torch.arange(self.width, device=device)  # (k,) 0, 1, ... (read only)
        prior = 0.5 * 0.5 ** torch.arange(self.width, dtype=torch.float32)  # rank r: 0.5, 0.25, ...
        self.rates = HitRates((DEPTHS, self.width), prior, device=device)  # P(the target's choice = M[t, r]) by depth
        self._tables: tuple[torch.Tensor, ...] = ()
        self._tables_version = -1
        # on a CPU, M and its written rows read on the host without a copy (NumPy views of the same memory)
        self.host = (self.next.numpy(), self.filled.numpy()) if self.next.device.type == "cpu" else None
        self._host_tables: tuple[np.ndarray, np.ndarray] | None = None
        self._host_tables_version = -1
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # rows' steps to `learn` from

    def queue(self, tokens: torch.Tensor, depths: torch.Tensor, logits: torch.Tensor) -> None:
        """A row's step, learned with the other rows' at the next `learn`: the target's logits (P, V) at positions
        reading `tokens` (P,) at `depths` (P,)."""
        self.pending.append((tokens, depths, logits))

    def learn(self) -> None:
        """Every queued step in one pass: M scored at all their positions (`observe_hits`), then rewritten (a token
        read at several positions keeps one of their rows). One top-k for a batch's rows: 8 rows of 5 positions, 8192
        logits each, in 0.6 against 0.96 ms a step row by row on a 2-core Xeon."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        tokens, depths, logits = pending[0] if len(pending) == 1 else (torch.cat(parts) for parts in zip(*pending))
        best = self.best(logits)  # (P, k): its first column is the target's choice (no argmax again)
        self.observe_hits(tokens, depths, best[:, 0])  # M scored before it is rewritten
        self.write(tokens, best)

    def record(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """M[tokens] = the k best next tokens of `logits` (P, V) read at `tokens` (P,)."""
        self.write(tokens, self.best(logits))

    def best(self, logits: torch.Tensor) -> torch.Tensor:
        """(P, V) logits -> (P, k) their k best next tokens, best first."""
        return logits.topk(self.width, dim=-1).indices

    def write(self, tokens: torch.Tensor, best: torch.Tensor) -> None:
        """M[tokens] = best (P, k)."""
        self.next[tokens] = best
        self.filled[tokens] = True

    def observe_hits(self, tokens: torch.Tensor, depths: torch.Tensor, choice: torch.Tensor) -> None:
        """Score M before it is rewritten: at positions reading `tokens` (P,) at `depths` (P,), which rank
        of M[token] (if any) was the target's `choice` (P,)."""
        seen = self.filled[tokens][:, None].expand(-1, self.width)  # (P, k) rows written before: scored
        hit = self.next[tokens] == choice[:, None]  # (P, k)
        depth = depths.clamp(max=DEPTHS - 1)[:, None].expand_as(hit)
        rank = self.ranks.expand_as(hit)
        self.rates.update((depth.flatten(), rank.flatten()), hit.flatten(), seen.flatten())

    def log_dist(self, tokens: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """(R,) tokens at (R,) depths -> (R, V) log-probabilities of the next token: M[t]'s ranks get
        their hit rates (at most MAX_LISTED_MASS together), the rest is uniform; uniform if M[t] is unset."""
        rates, spread = self._rates(tokens, depths)
        log_probs = spread.log().expand(-1, self.vocab).clone()  # (R, V)
        return log_probs.scatter_(1, self.next[tokens], (rates + spread).log())  # a row's k tokens differ

    def top(self, tokens: torch.Tensor, depths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k' = min(k, width) most likely next tokens of `log_dist`'s rows, without building them:
        (tokens (R, k'), log-probabilities (R, k')), best first. An unset row lists tokens 0.. (uniform)."""
        _, _, order, log_listed = self.tables()
        k, filled = min(k, self.width), self.filled[tokens, None]  # (R, 1)
        depths = on(depths, self.next.device).clamp(max=DEPTHS - 1)
        ranks = order[depths, :k]  # (R, k') a row's ranks by hit rate: the same for every row at one depth
        listed = torch.where(filled, self.next[tokens].gather(1, ranks), torch.arange(k, device=self.next.device))
        return listed, torch.where(filled, log_listed[depths, :k], -math.log(self.vocab))

    def host_top(self, tokens: np.ndarray, depth: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """`top` read on the host, for a matrix on the CPU (`host`) and rows all at one `depth`: (R,) tokens -> (R, k')
        tokens (int64) and (R, k') log-probabilities (float32): the same values as `top`'s, in NumPy."""
        order, log_listed = self.host_tables()
        (nxt, filled), k, depth = self.host, min(k, self.width), min(depth, DEPTHS - 1)
        written = filled[tokens][:, None]  # (R, 1)
        listed = np.where(written, nxt[tokens][:, order[depth, :k]], np.arange(k))
        return listed, np.where(written, log_listed[depth, :k], np.float32(-math.log(self.vocab)))

    def host_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """`tables`' ranks by probability and their log-probabilities, (DEPTHS, k) each, as NumPy arrays."""
        if self._host_tables_version != self.rates.version:
            _, _, order, log_listed = self.tables()
            self._host_tables, self._host_tables_version = (order.numpy(), log_listed.numpy()), self.rates.version
        return self._host_tables

    def tables(self) -> tuple[torch.Tensor, ...]:
        """Per depth: (DEPTHS, k) each rank's probability (a written row's k listed tokens claim at most
        MAX_LISTED_MASS together), (DEPTHS, 1) each other token's, (DEPTHS, k) the ranks by probability (best
        first) and (DEPTHS, k) their log-probabilities in that order. Derived again after the rates change."""
        if self._tables_version != self.rates.version:
            rates = self.rates.mean  # (DEPTHS, k)
            rates = rates * (MAX_LISTED_MASS / rates.sum(dim=1, keepdim=True)).clamp(max=1)
            spread = (1 - rates.sum(dim=1, keepdim=True)) / self.vocab  # (DEPTHS, 1)
            best = rates.sort(dim=1, descending=True, stable=True)
            self._tables, self._tables_version = (rates, spread, best.indices, (best.values + spread).log()), self.rates.version
        return self._tables

    def _rates(self, tokens: torch.Tensor, depths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, k) the probability of each listed token of M[tokens] at `depths`, (R, 1) each other token's."""
        rates, spread, _, _ = self.tables()
        depths, filled = on(depths, self.next.device).clamp(max=DEPTHS - 1), self.filled[tokens, None]  # (R,), (R, 1)
        return rates[depths] * filled, torch.where(filled, spread[depths], 1 / self.vocab)  # an unset row lists nothing

    def nbytes(self) -> int:
        return self.next.numel() * self.next.element_size()


class RecyclingDrafter(Declared):
    """The matrix as a `Drafter`: any tree policy can grow its tree from recycled tokens, no forward pass."""

    prompt_rows = PROMPT_ROWS  # the engine's prefill hands these prompt logits to `seed`
    top_children = True  # `root_top` / `expand_top`: M[t]'s ranks by hit rate, no (K, V) rows
    full_top_rows = True  # every row lists min(k, width) tokens with their (positive) estimates
    learns_together = True  # a batch's rows share the matrix: `observe` queues, `learned` learns from them all at once
    lists_on_host = False  # set per instance: True where M lives on the CPU (`host_root_top` / `host_expand_top`)

    def __init__(self, target, vocab: int, device: torch.device | str = "cpu"):
        self.matrix = per_model(target, f"recycling-{vocab}", lambda: RecyclingMatrix(vocab, device))
        self.device = self.matrix.next.device
        self.no_slots = torch.empty(0, dtype=torch.long, device=self.device)  # (0,) (read only)
        self.root_depth = torch.zeros(1, dtype=torch.long, device=self.device)  # (1,) the root's depth, 0 (read only)
        self.slot_depths = self.no_slots  # (S,) depth of each slot
        self.lists_on_host = self.matrix.host is not None

    def start(self, input_ids: torch.Tensor) -> None:
        self.slot_depths = self.no_slots

    def seed(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """The target's logits (P, V) at the prompt's positions reading `tokens` (P,) (cold start)."""
        self.matrix.record(tokens, logits)

    def root(self, committed: torch.Tensor) -> torch.Tensor:
        return self.matrix.log_dist(*self._root(committed))[0]

    def expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
        return self.matrix.log_dist(*self._expand(tokens, parent_slots))

    def root_top(self, committed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, logq = self.matrix.top(*self._root(committed), k)
        return tokens[0], logq[0]

    def expand_top(self, tokens: torch.Tensor, parent_slots: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.matrix.top(*self._expand(tokens, parent_slots), k)

    def host_root_top(self, root: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """`root_top` of the root token `root`, on the host: (k',) tokens, (k',) log-probabilities."""
        tokens, logq = self.matrix.host_top(np.array([root]), 0, k)
        return tokens[0], logq[0]

    def host_lister(self) -> RecyclingMatrix:
        """What answers `host_root_top` and `host_expand_top`: the matrix, which every row with this target shares."""
        return self.matrix

    def host_expand_top(self, tokens: np.ndarray, depth: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """`expand_top` of nodes (R,) all at `depth`, on the host: (R, k') tokens, (R, k') log-probabilities
        (no slots: a tree listed on the host is never expanded by slot)."""
        return self.matrix.host_top(tokens, depth, k)

    def _root(self, committed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A new tree: (1,) the root token, (1,) its depth 0."""
        self.slot_depths = self.no_slots
        return on(committed[-1:], self.device), self.root_depth

    def _expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Nodes (K,) take the next slots: (K,) their tokens, (K,) their depths."""
        parent_slots = on(parent_slots, self.device)
        if self.slot_depths.numel():
            depths = torch.where(parent_slots >= 0, self.slot_depths[parent_slots.clamp(min=0)] + 1, 1)  # (K,)
        else:
            depths = torch.ones_like(parent_slots)
        self.slot_depths = torch.cat([self.slot_depths, depths])
        return on(tokens, self.device), depths

    def observe(self, result) -> None:
        """The step's [root] + nodes (N + 1,) and the target's logits there, queued for `learned`."""
        self.matrix.queue(result.tokens, torch.nn.functional.pad(result.tree.depths, (1, 0)), result.logits)

    def learned(self) -> None:
        self.matrix.learn()

