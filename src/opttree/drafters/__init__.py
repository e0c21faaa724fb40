"""Drafters: who proposes tokens. A tree policy drives a drafter through this protocol.

Optional: a drafter with `prompt_rows = R > 0` also gets `seed(tokens (R,), logits (R, V))`, the
target's logits at the prompt's last R positions, from the prefill (Token Recycling's cold start);
one with `wants_hidden = True` gets the target's hidden states (`seed_hidden`, `Verification.hidden_states`);
one with `reads_target_cache = True` gets the target's cache after the prefill (`share_target_cache`)
and decodes one sequence at a time (it drafts on that cache).
One with `forwards_together = True` drafts, in a batch, in a thread of its own, and hands its
forwards to the round that batches them with the other rows' (`drafters.together`).
Sources that are not drafters (candidate tries) and the ways to combine them: `drafters.sources`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..verify import Verification


class Drafter(Protocol):
    def start(self, input_ids: torch.Tensor) -> None:
        """A new generation begins with the prompt `input_ids` (T,); drop any earlier state."""

    def root(self, committed: torch.Tensor) -> torch.Tensor:
        """Catch up on the committed tokens (T,) (the last one is the root) and return the draft's
        log-probabilities (V,) for the token after the root. Opens a new tree: slots restart at 0."""

    def expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
        """Run tree nodes (K,) whose parents are earlier slots of this step (-1 = root); they take the
        next K slots. Returns log-probabilities (K, V) of each node's children."""

    def observe(self, result: Verification) -> None:
        """The step's verification (after compaction): `result.accepted_slots` are the drafter's slots of
        the accepted nodes, root to leaf (-1 = never run by it); logits, tokens and bonus are there for
        drafters that learn from the target."""


class CheckedDrafter:
    """A user's Drafter, with its answers checked: log-probabilities over the target's vocabulary,
    each row normalised, no NaN or +inf (a clear error instead of a malformed tree later)."""

    def __init__(self, inner: Drafter, vocab: int):
        self.inner, self.vocab = inner, vocab

    def start(self, input_ids: torch.Tensor) -> None:
        self.inner.start(input_ids)

    def root(self, committed: torch.Tensor) -> torch.Tensor:
        return self._checked(self.inner.root(committed), "root")

    def expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
        return self._checked(self.inner.expand(tokens, parent_slots), "expand")

    def observe(self, result: Verification) -> None:
        if hasattr(self.inner, "observe"):
            self.inner.observe(result)
        else:  # a drafter written for opttree < 0.2, with `accept(slots)`
            self.inner.accept(result.accepted_slots)

    def _checked(self, logq: torch.Tensor, method: str) -> torch.Tensor:
        name = f"{type(self.inner).__name__}.{method}()"
        if logq.shape[-1] != self.vocab:
            raise ValueError(f"{name} returned {logq.shape[-1]} scores per row; the target's vocabulary has {self.vocab}")
        if bool(torch.isnan(logq).any() | torch.isposinf(logq).any()):
            raise ValueError(f"{name} returned NaN or +inf: a drafter returns log-probabilities (-inf = impossible)")
        total = torch.logsumexp(logq.float(), dim=-1)
        if not bool(((total - 0).abs() < 1e-3).all()):
            raise ValueError(f"{name} returned rows whose probabilities sum to {total.exp().flatten()[:3].tolist()}...: "
                             "return log-probabilities (log_softmax of the logits), not raw logits")
        return logq


from .model import ChainDrafter, ModelDrafter, model_drafter  # noqa: E402

__all__ = ["Drafter", "CheckedDrafter", "ChainDrafter", "ModelDrafter", "model_drafter"]
