"""The registry of tree policies: `register_policy(name)` makes a policy selectable by name,
`make_policy(config)` builds the one `config.tree` names. The built-in policies register themselves
when `opttree.step.policies` imports them."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from ...settings.config import SpecConfig
from ..drafters import Drafter
from ..tree import DraftTree


class TreePolicy(Protocol):
    needs_drafter: bool
    # At temperature > 0 its trees of sampled children carry the p-hat that chose them
    # (`DraftTree.keys`), so a candidate source's trie can join them under one budget, exactly (`MergedPolicy`).
    sampled_keys: bool

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
