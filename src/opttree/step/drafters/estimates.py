"""What train-free sources learn online: hit-rate estimates, and state kept per target model.

`HitRates` holds Beta posteriors of hit probabilities on a small grid (e.g. depth x rank): a source
scores its candidates with them, so its scores are calibrated estimates of acceptance
(docs/METHODS.md, "Draft sources") and compare with other sources'. `per_model` keeps such state, and Token Recycling's
matrix, across generations with the same target ("hot start"); `forget(target)` drops it, and `kept_apart` gives
some generations a state of their own (a benchmark's methods, each learning from its own runs only).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, TypeVar

import numpy as np
import torch

from ...device import on

T = TypeVar("T")
_STORE: "weakref.WeakKeyDictionary[object, dict[str, object]]" = weakref.WeakKeyDictionary()


def per_model(model, key: str, make: Callable[[], T]) -> T:
    """The state `key` kept for `model` (made by `make()` the first time); freed with the model."""
    states = _STORE.setdefault(model, {})
    if key not in states:
        states[key] = make()
    return states[key]  # type: ignore[return-value]


def forget(model) -> None:
    """Drop what the train-free sources learned about `model` (the next generation starts cold)."""
    _STORE.pop(model, None)


@contextlib.contextmanager
def kept_apart(model, states: dict):
    """Inside, generations with `model` start from what `states` holds and learn into it, not into the state
    the other generations with `model` share (left as it was). A benchmark gives each method its own: two
    methods run on the same prompt one after the other, the second would otherwise start from a matrix that
    has just learnt that prompt's continuation (measured: 3-7 % more tokens a step for `recycling+lookup`)."""
    shared = _STORE.pop(model, None)
    _STORE[model] = states
    try:
        yield states
    finally:
        _STORE.pop(model, None)
        if shared is not None:
            _STORE[model] = shared


class HitRates:
    """Beta posteriors of hit probabilities on a grid of `shape`: each cell starts at `prior` (a tensor
    broadcastable to `shape`) worth `strength` observations, and counts hits among trials."""

    def __init__(self, shape: tuple[int, ...], prior: torch.Tensor | float, strength: float = 4.0,
                 device: torch.device | str = "cpu"):
        self.trials = torch.full(shape, float(strength), device=device)
        self.hits = torch.as_tensor(prior, dtype=torch.float32, device=device).expand(shape) * strength
        self.version = 0  # counts the updates: what is derived from the estimates is derived again after one

    def update(self, index: tuple[torch.Tensor, ...], hit: torch.Tensor, counted: torch.Tensor | None = None) -> None:
        """One trial per row of `index` (cell coordinates, each (B,)); `hit` (B,) bool says which hit;
        `counted` (B,) bool, if given, leaves the other rows out (a fixed shape: nothing is read back)."""
        device = self.trials.device
        index = tuple(on(i, device) for i in index)
        weight = torch.ones(hit.shape[0], device=device) if counted is None else on(counted, device).float()
        self.trials.index_put_(index, weight, accumulate=True)
        self.hits.index_put_(index, on(hit, device).float() * weight, accumulate=True)
        self.version += 1

    @property
    def mean(self) -> torch.Tensor:
        """The posterior mean of every cell (float32, on the device the estimates live on)."""
        return self.hits / self.trials


class HostHitRates:
    """`HitRates` kept on the host (NumPy), for a source whose index lives there too (retrieval): it learns
    from what the host already holds and scores its proposals without a read from the device."""

    def __init__(self, shape: tuple[int, ...], prior: float, strength: float = 4.0):
        self.trials = np.full(shape, float(strength))
        self.hits = np.full(shape, float(prior) * strength)

    def update(self, index: tuple[list[int], ...], hit: list[bool]) -> None:
        """One trial per entry of `index` (cell coordinates, lists of one length); `hit` says which hit."""
        np.add.at(self.trials, index, 1.0)
        np.add.at(self.hits, index, np.asarray(hit, dtype=float))

    @property
    def mean(self) -> np.ndarray:
        return self.hits / self.trials
