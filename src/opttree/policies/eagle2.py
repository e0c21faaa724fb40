"""EAGLE-2: expand the top-k nodes of each layer by p-hat for a fixed depth, then rerank.

Layer 1 = the root's top-k children. At every later layer the k candidates of the previous layer
with the largest p-hat are run through the drafter (one forward over k tokens) and each gives its
top-k children, so a layer holds k * k candidates. After max_depth layers every candidate competes
and the `budget` best by p-hat form the tree (`select_best`). Unlike OPT-Tree, the depth is fixed
(delta is not used) and only k nodes per layer are expanded.

k = top_k(budget) = ceil(sqrt(budget)), within [2, MAX_TOP_K]: a layer then offers about `budget`
candidates (k * k). EAGLE-2's own setting is k = 10 for 60 nodes and depth 5-6; this gives k = 8 there.
Candidates are the draft's top tokens (deterministic), verified by token matching.
"""

from __future__ import annotations

import math

import torch

from ..config import SpecConfig
from ..drafters import Drafter
from ..tree import DraftTree
from .registry import register_policy
from .shapes import select_best

MAX_TOP_K = 10


def top_k(budget: int) -> int:
    return max(2, min(MAX_TOP_K, math.ceil(math.sqrt(budget))))


@register_policy("eagle2")
class Eagle2:
    needs_drafter = True

    def __init__(self, config: SpecConfig):
        self.n, self.depth, self.k = config.budget, config.max_depth, top_k(config.budget)

    def build(self, drafter: Drafter, committed: torch.Tensor, depth_limit: int) -> DraftTree:
        logq = drafter.root(committed)  # (V,)
        scores, tokens = logq.topk(min(self.k, logq.shape[0]))  # layer 1, (k,)
        layers = [(tokens, torch.full_like(tokens, -1), scores)]  # (tokens, parent candidate, log p-hat)
        slots = [torch.full_like(tokens, -1)]
        offset, next_slot = 0, 0  # offset = candidate index of the last layer's first node
        for _ in range(1, min(self.depth, depth_limit)):
            tokens, parents, scores = layers[-1]
            expand = scores.topk(min(self.k, scores.shape[0])).indices  # (k,) positions in the layer
            parent_slots = torch.cat(slots)[parents[expand].clamp(min=0)].masked_fill(parents[expand] < 0, -1)
            logq = drafter.expand(tokens[expand], parent_slots)  # (k, V)
            slots[-1][expand] = torch.arange(next_slot, next_slot + expand.shape[0], device=logq.device)
            next_slot += expand.shape[0]
            child_scores, child_tokens = (scores[expand, None] + logq).topk(min(self.k, logq.shape[1]), dim=1)  # (k, k)
            child_parents = (offset + expand)[:, None].expand_as(child_tokens)
            offset += tokens.shape[0]
            layers.append((child_tokens.flatten(), child_parents.flatten(), child_scores.flatten()))
            slots.append(torch.full_like(child_tokens.flatten(), -1))
        depths = torch.cat([torch.full_like(layer[0], d + 1) for d, layer in enumerate(layers)])
        return select_best(
            torch.cat([layer[0] for layer in layers]),
            torch.cat([layer[1] for layer in layers]),
            depths,
            torch.cat([layer[2] for layer in layers]),
            torch.cat(slots),
            self.n,
        )
