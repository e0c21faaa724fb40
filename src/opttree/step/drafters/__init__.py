"""Drafters: who proposes tokens. A tree policy drives a drafter through this protocol.

Optional hooks, each declared (`opttree.settings.declared.Declared`): `prompt_rows = R > 0` (it also gets
`seed(tokens, logits)` from the prefill), `wants_hidden` (`seed_hidden` and the hidden states),
`reads_target_cache` (`share_target_cache`), `forwards_together` (a batch's rows draft together),
`top_children` (`root_top` / `expand_top`: the best children without the (K, V) rows; `TopChildren`),
`extends_chains` (`extend(token)`: a chain's next node, as plain next-token decoding).
Sources that are not drafters (candidate tries) and the ways to combine them: `drafters.sources`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ...settings.declared import Declared, pass_hooks
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


class TopChildren(Protocol):
    """What a drafter declaring `top_children` also answers: the k most likely children of each node, for a
    policy that takes top-ranked children, without building (K, V) rows of which it reads k entries. The
    same tree as `topk` of `root` / `expand` rows, but for ties and for children of probability 0, which
    it need not list: a row may hold fewer than k (padded with -inf, its token then any)."""

    def root_top(self, committed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`root`, answered as (tokens (k',), log-probabilities (k',)), k' <= k, best first."""

    def expand_top(self, tokens: torch.Tensor, parent_slots: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """`expand`, answered as (tokens (K, k'), log-probabilities (K, k')), k' <= k, each row best first."""


class CheckedDrafter(Declared):
    """A user's Drafter, with its answers checked: log-probabilities over the target's vocabulary,
    each row normalised, no NaN or +inf; listed children (`top_children`) in the vocabulary, at most k
    (a clear error instead of a malformed tree later). Its
    declarations (`Declared`) are read once, here, and its optional hooks passed on."""

    def __init__(self, inner: Drafter, vocab: int):
        self.inner, self.vocab = inner, vocab
        declared = pass_hooks(self, inner)
        self.forwards_together, self.top_children = declared["forwards_together"], declared["top_children"]
        self.full_top_rows, self.extends_chains = declared["full_top_rows"], declared["extends_chains"]
        # a drafter written for opttree < 0.2 has `accept(slots)` instead of `observe`
        self._observe = inner.observe if hasattr(inner, "observe") else lambda r: inner.accept(r.accepted_slots)

    def start(self, input_ids: torch.Tensor) -> None:
        self.inner.start(input_ids)

    def root(self, committed: torch.Tensor) -> torch.Tensor:
        return self._checked(self.inner.root(committed), "root")

    def expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
        return self._checked(self.inner.expand(tokens, parent_slots), "expand")

    def extend(self, token: torch.Tensor) -> torch.Tensor:
        return self._checked(self.inner.extend(token), "extend")

    def observe(self, result: Verification) -> None:
        self._observe(result)

    def root_top(self, committed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._checked_top(*self.inner.root_top(committed, k), k, "root_top")

    def expand_top(self, tokens: torch.Tensor, parent_slots: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._checked_top(*self.inner.expand_top(tokens, parent_slots, k), k, "expand_top")

    def _checked_top(self, tokens: torch.Tensor, logq: torch.Tensor, k: int, method: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        name = f"{type(self.inner).__name__}.{method}()"
        if tokens.shape != logq.shape or tokens.shape[-1] > k or tokens.dtype != torch.long:
            raise ValueError(f"{name} returned tokens {tuple(tokens.shape)} {tokens.dtype} and log-probabilities "
                             f"{tuple(logq.shape)}: it lists at most k = {k} children a node, as long ids and "
                             "their log-probabilities of one shape")
        if bool((tokens < 0).any() | (tokens >= self.vocab).any() | torch.isnan(logq).any() | (logq > 1e-4).any()):
            raise ValueError(f"{name} returned a token outside the vocabulary ({self.vocab}) or a log-probability "
                             "that is NaN or above 0")
        return tokens, logq

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


from .model import ChainDrafter, ModelDrafter, StaticModelDrafter, model_drafter  # noqa: E402

__all__ = ["Declared", "Drafter", "CheckedDrafter", "ChainDrafter", "ModelDrafter", "StaticModelDrafter", "model_drafter"]
