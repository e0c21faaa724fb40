"""Classic speculative decoding: a chain of `budget` draft tokens.

Temperature 0 (or children="top"): the draft's greedy tokens, verified by matching. Temperature > 0
(children "auto" or "sampled"): speculative sampling, each token drawn from the draft's distribution
warped like the target's, the chain laid out once (`shapes.TreePlans`) and verified as one block
(`verify.accept_block`: block verification, which accepts at least as many tokens as checking each
token on its own with min(1, p / q))."""

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
        length = min(self.length, depth_limit)
        if self.picker.sampled:
            return self.plans.grow(drafter, committed, length, self.picker)
        logq = drafter.root(committed)  # (V,)
        device = logq.device
        tokens, scores, slots = [], [], []
        score = torch.zeros((), device=device)
        for depth in range(1, length + 1):
            token = logq.argmax()
            score = score + logq[token]
            tokens.append(token)
            scores.append(score)
            if depth < length:
                parent_slot = torch.tensor([depth - 2 if depth > 1 else -1], device=device)
                logq = drafter.expand(token.view(1), parent_slot)[0]
                slots.append(depth - 1)
            else:
                slots.append(-1)
        n = len(tokens)
        return DraftTree(
            tokens=torch.stack(tokens),
            parents=torch.arange(n, device=device) - 1,
            depths=torch.arange(1, n + 1, device=device),
            scores=torch.stack(scores),
            draft_slots=torch.tensor(slots, dtype=torch.long, device=device),
        )
