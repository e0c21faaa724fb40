"""Depth control: how deep each step drafts, a choice of its own for every policy and source (DESIGN.md section 15).

- `delta` (default): the policy's own rule; OPT-Tree stops deepening once a layer adds <= delta
  expected tokens.
- `fixed`: every step drafts `max_depth` layers (OPT-Tree without its delta stop).
- `thompson` (EESD): a Beta posterior over the per-token acceptance rate, updated by every
  verification (accepted tokens are successes, a rejection one failure, older evidence discounted),
  sampled each step; the step drafts the depth d that maximises the expected tokens per unit of time
  for that sample, (1 + a + ... + a^d) / (1 + d c), where c is a draft layer's cost relative to a
  verification, measured as the generation runs.

Depth only shapes the tree: the output is exact under every control.
"""

from __future__ import annotations

import random
from typing import Callable, Protocol

from .config import SpecConfig


class DepthControl(Protocol):
    def limit(self) -> int | None:
        """The deepest layer this step may draft (None: the policy's own rule)."""

    def observe(self, accepted: int, depth: int, draft_s: float, verify_s: float) -> None:
        """One step's outcome: draft tokens accepted, the tree's depth, and the step's draft / verify seconds."""


class PolicyDepth:
    """`delta` and `fixed`: no limit beyond the policy's own (under `fixed`, OPT-Tree skips its delta stop)."""

    def limit(self) -> int | None:
        return None

    def observe(self, accepted: int, depth: int, draft_s: float, verify_s: float) -> None:
        pass


class ThompsonDepth:
    def __init__(self, max_depth: int, seed: int = 0, discount: float = 0.95, layer_cost: float = 0.3):
        self.max_depth, self.discount = max_depth, discount
        self.successes, self.failures = 1.0, 1.0  # Beta(1, 1): no opinion yet
        self.layer_cost = layer_cost  # a draft layer's cost / a verification's, updated from measurements
        self.rng = random.Random(seed)  # its own stream: the token sampler's is untouched

    def limit(self) -> int:
        rate = self.rng.betavariate(self.successes, self.failures)
        return max(range(1, self.max_depth + 1), key=lambda d: self.tokens_per_cost(rate, d))

    def tokens_per_cost(self, rate: float, depth: int) -> float:
        """Expected tokens a step emits (a chain of `depth` at acceptance `rate`, bonus included) per its cost."""
        return sum(rate**k for k in range(depth + 1)) / (1 + depth * self.layer_cost)

    def observe(self, accepted: int, depth: int, draft_s: float, verify_s: float) -> None:
        rejected = 1.0 if accepted < depth else 0.0  # a full-depth acceptance has no rejection in it
        self.successes = self.discount * self.successes + accepted
        self.failures = self.discount * self.failures + rejected
        if depth and verify_s > 0:
            self.layer_cost = 0.9 * self.layer_cost + 0.1 * (draft_s / depth) / verify_s


DEPTH_CONTROLS: dict[str, Callable[[SpecConfig], DepthControl]] = {
    "delta": lambda config: PolicyDepth(),
    "fixed": lambda config: PolicyDepth(),
    "thompson": lambda config: ThompsonDepth(config.max_depth, config.seed),
}


def make_depth_control(config: SpecConfig) -> DepthControl:
    return DEPTH_CONTROLS[config.depth_control](config)
