"""Static trees: a fixed shape, given as a list of paths of child ranks, filled in at every step.

A path (0, 2) is "the 3rd-ranked child of the 1st-ranked child of the root". At run time the
shape is grown layer by layer (one drafter forward per layer, over the nodes that have children)
and a node's children are the top-ranked tokens of its draft distribution, so the candidates are
deterministic and `verify.matching_path` is exact at any temperature.

Built-in shapes, registered by name:
- `static`: an EAGLE-1 / Medusa-style tree, heavy on the draft's first choice. It is the `budget`
  best paths when a child of rank r is assumed accepted with probability `DEFAULT_RANK_WEIGHTS[r]`
  (how EAGLE-1 and Medusa built their trees from measured per-rank acceptance), at most
  `max_depth` deep.
- `static-k2`, `static-k3`: the k-ary tree of depth `max_depth`, breadth first, cut to `budget`.
- `recycling-template`: Token Recycling's tree (Luo et al. 2024): 80 nodes over 6 levels of widths
  8/21/25/15/8/3, here filled with the best children by `DEFAULT_RANK_WEIGHTS`; `budget=80` for the
  whole of it, a smaller budget keeps its best paths. Meant for `drafter="recycling"`.
Your own: `register_static_tree("mine", [[0], [1], [0, 0], ...])`, then `tree="mine"`.

A path list is in priority order: trimming keeps its first `budget` paths (of depth <= max_depth),
so every path must come after its parent.

The shape is laid out once per depth limit and filled each step by `opttree.step.policies.shapes`
(`TreePlans`, `grow`), shared with `sequoia` and the sampled trees of `opt` and `eagle2`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ...settings.config import SpecConfig
from ..drafters import Drafter
from ..tree import DraftTree
from .registry import register_policy
from .shapes import (ChildPicker, Path, TreePlans, check_paths, kary_paths, layered_paths, ranked_paths,
                     valued_paths)

# Assumed acceptance of a child by rank, for the default tree: first-rank heavy, like EAGLE-1's.
DEFAULT_RANK_WEIGHTS = (0.55, 0.2, 0.1, 0.05, 0.03, 0.02, 0.01, 0.01)
RECYCLING_TEMPLATE_WIDTHS = (8, 21, 25, 15, 8, 3)  # Token Recycling's tree: 80 nodes, 6 levels

PathSource = Callable[[int, int], Sequence[Sequence[int]]]  # (budget, max_depth) -> paths, best first


class StaticTree:
    """A fixed shape from `paths(budget, max_depth)`: its first `budget` paths of depth <= max_depth."""

    needs_drafter = True
    sampled_keys = False

    def __init__(self, config: SpecConfig, paths: PathSource):
        chosen = [list(p) for p in paths(config.budget, config.max_depth) if len(p) <= config.max_depth]
        chosen = chosen[: config.budget]
        seen: set[Path] = set()
        for p in chosen:  # priority order must keep every prefix of the list a tree
            if len(p) > 1 and tuple(p[:-1]) not in seen:
                raise ValueError(f"static tree path {p} comes before its parent {p[:-1]}: list parents first")
            seen.add(tuple(p))
        self.paths = check_paths(chosen)
        self.picker = ChildPicker(config, sampled=False)
        acceptance = self.picker.acceptance  # the p-hat of sampled children (children="sampled")
        self.plans = TreePlans(lambda max_depth, vocab: valued_paths(self.paths, acceptance, max_depth, vocab))

    def build(self, drafter: Drafter, committed: torch.Tensor, depth_limit: int) -> DraftTree:
        return self.plans.grow(drafter, committed, depth_limit, self.picker)


def register_static_tree(name: str, paths: Sequence[Sequence[int]] | PathSource) -> None:
    """Make a fixed tree selectable as `tree=name`: a list of paths of child ranks in priority order
    (trimmed to the budget), or a function (budget, max_depth) -> such a list."""
    source = paths if callable(paths) else (lambda budget, max_depth, fixed=[list(p) for p in paths]: fixed)
    register_policy(name)(lambda config: StaticTree(config, source))


register_static_tree("static", lambda budget, max_depth: ranked_paths(DEFAULT_RANK_WEIGHTS, budget, max_depth))
register_static_tree("static-k2", lambda budget, max_depth: kary_paths(2, budget, max_depth))
register_static_tree("static-k3", lambda budget, max_depth: kary_paths(3, budget, max_depth))
register_static_tree("recycling-template", layered_paths(RECYCLING_TEMPLATE_WIDTHS, DEFAULT_RANK_WEIGHTS))
