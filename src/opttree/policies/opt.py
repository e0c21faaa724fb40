"""OPT-Tree: the tree of `budget` nodes maximising E(A) = sum of p-hat, built layer by layer.

The n nodes with the largest p-hat over all candidates form the optimal tree, and the candidates
of layer d + 1 need only be the n best children of layer d. Deepening stops once the best
n-node tree gains no more than `delta` expected tokens, decided before the next draft forward.
"""

from __future__ import annotations

import torch

from ..config import SpecConfig
from ..drafters import Drafter
from ..tree import DraftTree
from .registry import register_policy
from .shapes import select_best


@register_policy("opt")
class OptTree:
    needs_drafter = True

    def __init__(self, config: SpecConfig):
        self.n, self.delta, self.max_depth = config.budget, config.delta, config.max_depth
        if config.depth_control != "delta":  # the control sets the depth: every layer up to it is drafted
            self.delta = float("-inf")

    def build(self, drafter: Drafter, committed: torch.Tensor, depth_limit: int) -> DraftTree:
        n, max_depth = self.n, min(self.max_depth, depth_limit)
        logq = drafter.root(committed)  # (V,)
        scores, tokens = logq.topk(min(n, logq.shape[0]))  # layer 1, (k,)
        parents = torch.full_like(tokens, -1)  # candidate index of the parent, -1 = root
        layers = [(tokens, parents, scores)]
        offset, e_prev = 0, 0.0  # offset = candidate index of the last layer's first node
        # Layers are expanded whole and in order, so an expanded candidate's drafter slot is its index.
        for depth in range(1, max_depth + 1):
            all_scores = torch.cat([layer[2] for layer in layers])
            e_depth = float(all_scores.topk(min(n, all_scores.shape[0])).values.exp().sum())
            if depth == max_depth or e_depth - e_prev <= self.delta:
                break
            e_prev = e_depth
            tokens, parents, scores = layers[-1]
            logq = drafter.expand(tokens, parents)  # (k, V)
            best = logq.topk(min(n, logq.shape[1]), dim=1)  # (k, n'): only a row's n best can make the top n
            child = (scores[:, None] + best.values).flatten()  # (k * n',) log p-hat of those children
            scores, flat = child.topk(min(n, child.shape[0]))
            width = best.indices.shape[1]
            layers.append((best.indices.flatten()[flat], offset + flat // width, scores))
            offset += tokens.shape[0]
        sizes = [layer[0].shape[0] for layer in layers]
        candidates = torch.arange(sum(sizes), device=logq.device)
        slots = torch.where(candidates < offset, candidates, -1)  # the last layer was never run
        depths = torch.cat([torch.full((size,), d + 1, device=logq.device) for d, size in enumerate(sizes)])
        return select_best(
            torch.cat([layer[0] for layer in layers]),
            torch.cat([layer[1] for layer in layers]),
            depths,
            torch.cat([layer[2] for layer in layers]),
            slots,
            n,
        )
