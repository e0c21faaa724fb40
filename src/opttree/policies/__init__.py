"""Tree policies: who decides the shape of the draft tree. Selected by name from a registry."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from ..config import SpecConfig
from ..drafters import Drafter
from ..tree import DraftTree


class TreePolicy(Protocol):
    needs_drafter: bool

    def build(self, drafter: Drafter, committed: torch.Tensor, depth_limit: int) -> DraftTree:
        """Draft a tree after `committed` (T,) (the last token is the root), at most `depth_limit` deep."""


PolicyFactory = Callable[[SpecConfig], TreePolicy]
_REGISTRY: dict[str, PolicyFactory] = {}


def register_policy(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Class decorator: make a policy selectable by `name` in the API, the CLI and the benchmark."""

    def add(factory: PolicyFactory) -> PolicyFactory:
        _REGISTRY[name] = factory
        return factory

    return add


def available() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(config: SpecConfig) -> TreePolicy:
    if config.tree not in _REGISTRY:
        raise ValueError(f"unknown tree policy {config.tree!r}; available: {', '.join(available())}")
    return _REGISTRY[config.tree](config)


def select_best(
    tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor, slots: torch.Tensor, n: int
) -> DraftTree:
    """The n candidates with the largest score (log p-hat), ties to the earlier (shallower) one.

    Candidates (C,) must be sorted by depth, with `parents` indexing candidates (-1 = root). As a
    child never scores above its parent, the chosen set is a connected tree containing the root.
    """
    order = torch.sort(scores, descending=True, stable=True).indices[:n]
    chosen = order.sort().values  # (n,) back in candidate (= depth) order
    new_index = torch.full((tokens.shape[0] + 1,), -1, dtype=torch.long, device=tokens.device)  # [c + 1] = tree index of candidate c
    new_index[chosen + 1] = torch.arange(chosen.shape[0], device=tokens.device)
    tree_parents = new_index[parents[chosen] + 1]
    assert bool((tree_parents >= 0).eq(parents[chosen] >= 0).all()), "selected set is not a tree"
    return DraftTree(tokens[chosen], tree_parents, depths[chosen], scores[chosen], slots[chosen])


from . import ar, chain, dyspec, eagle2, opt, sequoia, static  # noqa: E402,F401  (register the built-in policies)

__all__ = ["TreePolicy", "register_policy", "available", "make_policy", "select_best"]
