"""Plain autoregressive decoding: an empty tree, so each step is one target forward on the root."""

from __future__ import annotations

import torch

from ...settings.config import SpecConfig
from ..drafters import Drafter
from ..tree import DraftTree
from .registry import register_policy


@register_policy("ar")
class Autoregressive:
    needs_drafter = False
    sampled_keys = False

    def __init__(self, config: SpecConfig):
        pass

    def build(self, drafter: Drafter, committed: torch.Tensor, depth_limit: int) -> DraftTree:
        return DraftTree.empty(committed.device)
