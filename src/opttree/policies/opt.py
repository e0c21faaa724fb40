"""OPT-Tree: the tree of `budget` nodes maximising E(A) = sum of p-hat, built layer by layer.

The n nodes with the largest p-hat over all candidates form the optimal tree, and the candidates
of layer d + 1 need only be the n best children of layer d. Deepening stops once the best
n-node tree gains no more than `delta` expected tokens, decided before the next draft forward.

Where that decision is made: on the host, reading each layer's gain before the next draft forward
(no forward is wasted: what a CPU needs, where a draft layer costs a few ms), or on the device
(`stop_on_device`: every layer up to max_depth is drafted, the stop depth is found from the gains
on the device and deeper candidates are masked out, so nothing is read back: what a GPU needs, where
a draft layer over n nodes costs about as much as over one and a read stalls the queue). Both give
the same tree. By default the device decides off the CPU.
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

    stop_on_device: bool | None = None  # where the delta stop is decided (module docstring); None: off the CPU

    def __init__(self, config: SpecConfig):
        self.n, self.delta, self.max_depth = config.budget, config.delta, config.max_depth
        if config.depth_control != "delta":  # the control sets the depth: every layer up to it is drafted
            self.delta = float("-inf")

    def build(self, drafter: Drafter, committed: torch.Tensor, depth_limit: int) -> DraftTree:
        n, max_depth = self.n, min(self.max_depth, depth_limit)
        logq = drafter.root(committed)  # (V,)
        on_device = self.stop_on_device if self.stop_on_device is not None else logq.device.type != "cpu"
        scores, tokens = logq.topk(min(n, logq.shape[0]))  # layer 1, (k,)
        parents = torch.full_like(tokens, -1)  # candidate index of the parent, -1 = root
        layers = [(tokens, parents, scores)]
        offset, e_prev = 0, 0.0  # offset = candidate index of the last layer's first node
        gains = []  # on the device: () per layer, E_d - E_(d-1)
        # Layers are expanded whole and in order, so an expanded candidate's drafter slot is its index.
        for depth in range(1, max_depth + 1):
            all_scores = torch.cat([layer[2] for layer in layers])
            e_depth = all_scores.topk(min(n, all_scores.shape[0])).values.exp().sum()  # ()
            if depth == max_depth:
                break
            if not on_device:
                e_depth = float(e_depth)  # the layer's one read
                if e_depth - e_prev <= self.delta:
                    break
            else:
                gains.append(e_depth - e_prev)
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
        all_scores = torch.cat([layer[2] for layer in layers])
        if gains:  # the host-side rule, on the device: layers past the first small gain are masked out
            small = torch.stack(gains) <= self.delta  # (L - 1,): [d - 1] = stop before drafting layer d + 1
            stop = torch.where(small.any(), small.long().argmax() + 1, len(layers))  # () layers kept
            all_scores = all_scores.masked_fill(depths > stop, float("-inf"))
        return select_best(
            torch.cat([layer[0] for layer in layers]),
            torch.cat([layer[1] for layer in layers]),
            depths,
            all_scores,
            slots,
            n,
        )
