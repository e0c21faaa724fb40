"""Depth control: how deep each step drafts, a choice of its own for every policy and source (docs/METHODS.md,
"Depth control").

- `delta` (default): the policy's own rule; OPT-Tree stops deepening once a layer adds <= delta
  expected tokens.
- `fixed`: every step drafts `max_depth` layers (OPT-Tree without its delta stop; so do the controls
  below, each with the depth it chose).
- `thompson` (EESD): a Beta posterior over the per-token acceptance rate, updated by every
  verification (accepted tokens are successes, a rejection one failure, older evidence discounted),
  sampled each step; the step drafts the depth d that maximises the expected tokens per unit of time
  for that sample, (1 + a + ... + a^d) / (1 + d c), where c is a draft layer's cost relative to a
  verification, measured as the generation runs.
- `predictor` (AdaEAGLE): a small trained network reads the target's last hidden state and the root's
  embedding and predicts the step's accepted length, as P(at least k tokens accepted) for each k; the
  step drafts the depth that maximises the same expected tokens per cost with those probabilities
  (`opttree.step.length`, trained by `opttree train length-predictor`).

Depth only shapes the tree: the output is exact under every control.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Callable, Protocol

from ..settings.config import SpecConfig
from ..settings.declared import Declared

if TYPE_CHECKING:
    import torch


class DepthControl(Protocol):
    def limit(self, root: torch.Tensor, feature: torch.Tensor | None) -> int | None:
        """The deepest layer this step may draft (None: the policy's own rule). root: () the step's root
        token; feature: (H,) the target's last hidden state at the token before it, for a control with
        `wants_hidden = True` (None otherwise, or before the target ran)."""

    def observe(self, accepted: int, depth: int, draft_s: float, verify_s: float) -> None:
        """One step's outcome: draft tokens accepted, the tree's depth, and the step's draft / verify seconds."""


class PolicyDepth(Declared):
    """`delta` and `fixed`: no limit beyond the policy's own (under `fixed`, OPT-Tree skips its delta stop)."""

    def limit(self, root, feature) -> int | None:
        return None

    def observe(self, accepted: int, depth: int, draft_s: float, verify_s: float) -> None:
        pass


class CostAwareDepth(Declared):
    """Picks the depth d maximising expected tokens per unit of time, (1 + sum_k<=d P(A >= k)) / (1 + d c),
    with c a draft layer's cost relative to a verification, measured as the generation runs."""

    def __init__(self, max_depth: int, layer_cost: float = 0.3):
        self.max_depth, self.layer_cost = max_depth, layer_cost

    def best_depth(self, reach: list[float]) -> int:
        """reach[k - 1] = P(at least k drafted tokens are accepted), k = 1..max_depth."""
        gains = [1.0]
        for p in reach[: self.max_depth]:
            gains.append(gains[-1] + p)
        return max(range(1, len(gains)), key=lambda d: gains[d] / (1 + d * self.layer_cost))

    def observe(self, accepted: int, depth: int, draft_s: float, verify_s: float) -> None:
        if depth and verify_s > 0:
            self.layer_cost = 0.9 * self.layer_cost + 0.1 * (draft_s / depth) / verify_s


class ThompsonDepth(CostAwareDepth):
    def __init__(self, max_depth: int, seed: int = 0, discount: float = 0.95, layer_cost: float = 0.3):
        super().__init__(max_depth, layer_cost)
        self.discount = discount
        self.successes, self.failures = 1.0, 1.0  # Beta(1, 1): no opinion yet
        self.rng = random.Random(seed)  # its own stream: the token sampler's is untouched

    def limit(self, root=None, feature=None) -> int:
        rate = self.rng.betavariate(self.successes, self.failures)
        return self.best_depth([rate**k for k in range(1, self.max_depth + 1)])

    def observe(self, accepted: int, depth: int, draft_s: float, verify_s: float) -> None:
        rejected = 1.0 if accepted < depth else 0.0  # a full-depth acceptance has no rejection in it
        self.successes = self.discount * self.successes + accepted
        self.failures = self.discount * self.failures + rejected
        super().observe(accepted, depth, draft_s, verify_s)


class PredictorDepth(CostAwareDepth):
    """AdaEAGLE: P(A >= k) from a trained `opttree.step.length.LengthPredictor` for this step's root and feature."""

    wants_hidden = True  # the engine hands over the target's last hidden state at each step

    def __init__(self, predictor, target, max_depth: int):
        super().__init__(max_depth)
        self.predictor, self.embed = predictor, target.get_input_embeddings()

    def limit(self, root: torch.Tensor, feature: torch.Tensor | None) -> int:
        embed = self.embed(root.view(1))  # (1, H)
        feature = embed.new_zeros(embed.shape) if feature is None else feature.view(1, -1).to(embed.dtype)
        reach = self.predictor.reach(self.predictor(feature, embed))[0]  # (D,)
        return self.best_depth(reach.tolist())


def _predictor(config: SpecConfig, target) -> DepthControl:
    from .length import load_length_predictor

    if config.length_predictor is None:
        raise ValueError("depth_control='predictor' needs a length predictor trained for this target: "
                         "length_predictor=DIR / --length-predictor DIR (train one with `opttree train "
                         "length-predictor --target PATH --out DIR`)")
    return PredictorDepth(load_length_predictor(config.length_predictor, target), target, config.max_depth)


DEPTH_CONTROLS: dict[str, Callable[[SpecConfig, object], DepthControl]] = {
    "delta": lambda config, target: PolicyDepth(),
    "fixed": lambda config, target: PolicyDepth(),
    "thompson": lambda config, target: ThompsonDepth(config.max_depth, config.seed),
    "predictor": _predictor,
}


def make_depth_control(config: SpecConfig, target=None) -> DepthControl:
    if config.length_predictor is not None and config.depth_control != "predictor":
        raise ValueError(f"a length predictor was given but depth_control={config.depth_control!r}: use "
                         "depth_control='predictor' or leave the predictor out")
    return DEPTH_CONTROLS[config.depth_control](config, target)
