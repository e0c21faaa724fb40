"""Several rows' trees at once (a batch's drafting): OPT-Tree over children listed on the host through one lister
(Token Recycling's matrix, which a batch's rows share) grows the layers of every such row together
(`OptTree.build_listed_rows`), then each row's other sources' tries are merged in where its policy merges them
(`MergedPolicy`). The same trees as each row's own `build`."""

from __future__ import annotations

import torch

from ..drafters import Drafter
from ..drafters.sources import MergedPolicy
from ..tree import DraftTree
from .opt import OptTree
from .registry import TreePolicy

Build = tuple[TreePolicy, Drafter, torch.Tensor, int]  # a row's policy, drafter, committed tokens (T,), depth limit


def _listed(build: Build) -> OptTree | None:
    """The OPT-Tree of a row whose tree is listed on the host (under its merge, where its policy merges), or None."""
    policy, drafter, _, _ = build
    inner = policy.policy if isinstance(policy, MergedPolicy) else policy
    return inner if isinstance(inner, OptTree) and inner.listed_together(drafter) else None


def listed_groups(builds: list[Build]) -> list[list[int]]:
    """The builds whose trees grow together (`build_listed`), in groups of two or more: one lister, budget and delta."""
    groups: dict[tuple, list[int]] = {}
    for i, build in enumerate(builds):
        policy = _listed(build)
        if policy is not None:
            groups.setdefault((id(build[1].host_lister()), policy.n, policy.delta), []).append(i)
    return [group for group in groups.values() if len(group) > 1]


def build_listed(builds: list[Build]) -> list[DraftTree]:
    """The trees of one group of `listed_groups`, each as its policy's `build` makes it."""
    grown = OptTree.build_listed_rows([(_listed(build), *build[1:]) for build in builds])
    return [policy.merged(drafter, committed, limit, tree) if isinstance(policy, MergedPolicy) else tree
            for (policy, drafter, committed, limit), tree in zip(builds, grown)]
