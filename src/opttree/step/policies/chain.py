"""Classic speculative decoding: a chain of `budget` draft tokens, laid out once (`shapes.TreePlans`) and filled
each step (`shapes.grow`).

Temperature 0 (or children="top"): the draft's greedy tokens, verified by matching. Temperature > 0
(children "auto" or "sampled"): speculative sampling, each token drawn from the draft's distribution
warped like the target's and the chain verified as one block (`verify.accept_block`: block
verification, which accepts at least as many tokens as checking each token on its own with min(1, p / q))."""

from __future__ import annotations

import torch

from ...settings.config import SpecConfig
from ..drafters import Drafter
from ..tree import DraftTree
from .registry import register_policy
from .shapes import ChildPicker, TreePlans, valued_paths


@register_policy("chain")
class Chain:
    needs_drafter = True
    sampled_keys = False

    def __init__(self, config: SpecConfig):
        self.length = config.budget
        self.picker = ChildPicker(config, sampled=True)  # top-ranked tokens at temperature 0
        self.plans = TreePlans(lambda max_depth, vocab: valued_paths(
            [(0,) * depth for depth in range(1, self.length + 1)], self.picker.acceptance, max_depth, vocab))

    def build(self, drafter: Drafter, committed: torch.Tensor, depth_limit: int) -> DraftTree:
        return self.plans.grow(drafter, committed, min(self.length, depth_limit), self.picker)
