"""Drafters: who proposes tokens. A tree policy drives a drafter through this protocol."""

from __future__ import annotations

from typing import Protocol

import torch


class Drafter(Protocol):
    def start(self, input_ids: torch.Tensor) -> None:
        """A new generation begins with the prompt `input_ids` (T,); drop any earlier state."""

    def root(self, committed: torch.Tensor) -> torch.Tensor:
        """Catch up on the committed tokens (T,) (the last one is the root) and return the draft's
        log-probabilities (V,) for the token after the root. Opens a new tree: slots restart at 0."""

    def expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
        """Run tree nodes (K,) whose parents are earlier slots of this step (-1 = root); they take the
        next K slots. Returns log-probabilities (K, V) of each node's children."""

    def accept(self, slots: torch.Tensor) -> None:
        """The target accepted the nodes with these slots, root to leaf (-1 = never run by the drafter)."""


from .model import ModelDrafter  # noqa: E402

__all__ = ["Drafter", "ModelDrafter"]
