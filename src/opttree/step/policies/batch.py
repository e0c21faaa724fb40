"""Batch-level OPT-Tree: one node budget for a whole batch, chosen each step (`BatchBudget`)."""

from __future__ import annotations

from typing import Sequence

import torch

from ..tree import DraftTree, allocate, candidate_scores


class BatchBudget:
    """The batch's node budget N each step, split among the rows by `tree.allocate` (the N candidates
    with the largest path probabilities, whichever rows they belong to).

    With a latency curve (`curve[k - 1]` = seconds of a target forward over k new tokens, as
    `opttree calibrate` measures it), N is the one that makes the batch's tokens per second largest:
    (B + the sum of the top N path probabilities) / T(B + N), for B rows (each verifies its root and
    gains its bonus token). Past the measured range T grows in proportion to k. Under load (many rows)
    the rise of the curve shrinks the trees toward chains and toward plain decoding on their own.
    With `fixed`, N is that number. Reads the device once per step (the chosen N)."""

    def __init__(self, curve: Sequence[float] | None = None, fixed: int | None = None):
        if (curve is None) == (fixed is None):
            raise ValueError("BatchBudget takes a latency curve or a fixed budget, one of them")
        if fixed is not None and fixed < 0:
            raise ValueError(f"a batch's node budget must be >= 0, got {fixed}")
        if curve is not None and (not len(curve) or min(curve) <= 0):
            raise ValueError("a latency curve is a non-empty list of positive seconds (entry k - 1 = T(k))")
        self.curve = None if curve is None else torch.tensor(list(curve), dtype=torch.float64)
        self.fixed = fixed

    def nodes(self, costs: list) -> list[int | None]:
        """Every row drafts its own budget: the batch's budget then picks among all their candidates (and
        shrinks the trees under load on its own, no row decoding plainly by choice)."""
        return [None] * len(costs)

    def __call__(self, trees: list[DraftTree], nodes: list[int | None] | None = None) -> list[DraftTree]:
        """The trees the batch verifies (`nodes` is not read: every row drafted its own, one budget binds them)."""
        if self.fixed is not None:
            return allocate(trees, self.fixed)
        scores = candidate_scores(trees)  # (M,) computed once for the choice and the cut
        return allocate(trees, self._best(scores, len(trees)), scores)

    def best_total(self, trees: list[DraftTree]) -> int:
        """The N that maximises the batch's expected tokens per second under the curve."""
        return self._best(candidate_scores(trees), len(trees))

    def _best(self, scores: torch.Tensor, rows: int) -> int:
        if not scores.numel():
            return 0
        p = scores.double().cpu().exp().sort(descending=True).values  # (M,) path probabilities, best first
        gain = rows + torch.cat([p.new_zeros(1), p.cumsum(0)])  # (M + 1,) tokens for N = 0..M
        k = rows + torch.arange(p.shape[0] + 1)  # tokens verified for N = 0..M
        return int((gain / self.seconds(k)).argmax())

    def seconds(self, k: torch.Tensor) -> torch.Tensor:
        """T(k) from the curve; past its end, in proportion to k."""
        last = self.curve.shape[0]
        inside = self.curve[(k.clamp(max=last) - 1)]
        return torch.where(k > last, self.curve[-1] * k / last, inside)
