"""EAGLE-2: expand the top-k nodes of each layer by p-hat for a fixed depth, then rerank.

Layer 1 = the root's top-k children. At every later layer the k candidates of the previous layer
with the largest p-hat are run through the drafter (one forward over k tokens) and each gives its
top-k children, so a layer holds k * k candidates. After max_depth layers every candidate competes
and the `budget` best by p-hat form the tree (`select_best`). Unlike OPT-Tree, the depth is fixed
(delta is not used) and only k nodes per layer are expanded.

k = top_k(budget) = ceil(sqrt(budget)), within [2, MAX_TOP_K]: a layer then offers about `budget`
candidates (k * k). EAGLE-2's own setting is k = 10 for 60 nodes and depth 5-6; this gives k = 8 there.
Candidates are the draft's top tokens (deterministic), verified by token matching. When sampling
(temperature > 0, children="sampled", the default "auto"), they are draws without replacement whose p-hat
is their parent's times the acceptance of their draw rank, as in OPT-Tree, verified by recursive rejection
sampling.
"""

from __future__ import annotations

import math

import torch

from ...settings.config import SpecConfig
from ..drafters import Drafter
from ..tree import DraftTree
from .registry import register_policy
from .shapes import ChildPicker, select_best

MAX_TOP_K = 10


def top_k(budget: int) -> int:
    return max(2, min(MAX_TOP_K, math.ceil(math.sqrt(budget))))


@register_policy("eagle2")
class Eagle2:
    needs_drafter = True
    sampled_keys = True

    def __init__(self, config: SpecConfig):
        self.n, self.depth, self.k = config.budget, config.max_depth, top_k(config.budget)
        self.picker = ChildPicker(config, sampled=True)  # at temperature > 0, as OPT-Tree (module docstring)

    def build(self, drafter: Drafter, committed: torch.Tensor, depth_limit: int) -> DraftTree:
        picker, k = self.picker, self.k
        dist = picker.log_dist(drafter.root(committed)[None])  # (1, V)
        tokens, scores = (x[0] for x in picker.ranked(torch.zeros(1, device=dist.device), dist, k))  # layer 1, (k,)
        layers = [(tokens, torch.full_like(tokens, -1), scores)]  # (tokens, parent candidate, log p-hat)
        slots = [torch.full_like(tokens, -1)]
        probs, prob_rows = [dist.exp()], [torch.zeros(1, dtype=torch.long, device=dist.device)]  # sampled: [root] + expanded
        offset, next_slot = 0, 0  # offset = candidate index of the last layer's first node
        for _ in range(1, min(self.depth, depth_limit)):
            tokens, parents, scores = layers[-1]
            expand = scores.topk(min(k, scores.shape[0])).indices  # (k,) positions in the layer
            parent_slots = torch.cat(slots)[parents[expand].clamp(min=0)].masked_fill(parents[expand] < 0, -1)
            dist = picker.log_dist(drafter.expand(tokens[expand], parent_slots))  # (k, V)
            slots[-1][expand] = torch.arange(next_slot, next_slot + expand.shape[0], device=dist.device)
            if picker.sampled:
                probs.append(dist.exp())
                prob_rows.append(offset + expand + 1)
            next_slot += expand.shape[0]
            child_tokens, child_scores = picker.ranked(scores[expand], dist, k)  # (k, k)
            child_parents = (offset + expand)[:, None].expand_as(child_tokens)
            offset += tokens.shape[0]
            layers.append(tuple(x.flatten() for x in (child_tokens, child_parents, child_scores)))
            slots.append(torch.full_like(child_tokens.flatten(), -1))
        depths = torch.cat([torch.full_like(layer[0], d + 1) for d, layer in enumerate(layers)])
        tokens, parents, scores = (torch.cat([layer[i] for layer in layers]) for i in range(3))
        if not picker.sampled:
            return select_best(tokens, parents, depths, scores, torch.cat(slots), self.n)
        probs = torch.cat(probs + [dist.new_zeros(1, dist.shape[1])])  # (runs + 1 + 1, V): a zero row last
        row = torch.full((tokens.shape[0] + 1,), probs.shape[0] - 1, dtype=torch.long, device=dist.device)
        row[torch.cat(prob_rows)] = torch.arange(probs.shape[0] - 1, device=dist.device)  # [c + 1] = row of candidate c
        return select_best(tokens, parents, depths, scores, torch.cat(slots), self.n, keys=scores, probs=probs[row])
