"""OPT-Tree: the tree of `budget` nodes maximising E(A) = sum of p-hat, built layer by layer.

The n nodes with the largest p-hat over all candidates form the optimal tree, and the candidates
of layer d + 1 need only be the n best children of layer d. Deepening stops once the best
n-node tree gains no more than `delta` expected tokens, decided before the next draft forward.

Where that decision is made: on the host (the default, every device), reading each layer's gain
before the next draft forward, so no forward is wasted; or on the device (`stop_on_device`: every layer
up to max_depth is drafted, the stop depth is found from the gains on the device and deeper candidates
are masked out, so nothing is read back until the acceptance). Both give the same tree. The device stop
was meant for GPUs, where a read stalls the launch queue; measured on an H100 with both models' steps in
CUDA graphs (docs/BENCHMARKS.md), the host stop is the faster one there too: 11.3 against 16.3 ms a step
for `opt@16`, 12.6 against 20.5 ms for `recycling+lookup@16`. A read costs less than the layers it saves.

Sampling (temperature > 0), children="sampled" (the default, "auto"): a node's children are draws
without replacement from the draft's distribution warped like the target's, verified by recursive
rejection sampling, which accepts a child x with min(1, p(x) / q(x)) rather than p(x). A drawn child's
p-hat is then its parent's times the acceptance of its draw rank (`ChildPicker.ranked`), and the tree is
the n nodes with the largest p-hat, with the same delta stop. Why that is exact: docs/METHODS.md, "OPT-Tree
with sampled children". children="top": the top-n tree, verified by matching.
"""

from __future__ import annotations

import torch

from ...settings.config import SpecConfig
from ..drafters import Drafter
from ..tree import DraftTree
from .registry import register_policy
from .shapes import ChildPicker, select_best


@register_policy("opt")
class OptTree:
    needs_drafter = True
    sampled_keys = True

    stop_on_device = False  # where the delta stop is decided (module docstring): the host, on every device

    def __init__(self, config: SpecConfig):
        self.n, self.delta, self.max_depth = config.budget, config.delta, config.max_depth
        if config.depth_control != "delta":  # the control sets the depth: every layer up to it is drafted
            self.delta = float("-inf")
        self.picker = ChildPicker(config, sampled=True)  # at temperature > 0 (module docstring)

    def build(self, drafter: Drafter, committed: torch.Tensor, depth_limit: int) -> DraftTree:
        n, max_depth, picker = self.n, min(self.max_depth, depth_limit), self.picker
        top = drafter.top_children and not picker.sampled  # the drafter lists each node's best children itself
        if top:
            tokens, scores = drafter.root_top(committed, n)  # layer 1, (k,)
            probs = []
        else:
            dist = picker.log_dist(drafter.root(committed)[None])  # (1, V)
            tokens, scores = (x[0] for x in picker.ranked(torch.zeros(1, device=dist.device), dist, n))  # layer 1, (k,)
            probs = [dist.exp()] if picker.sampled else []  # sampled: the distributions children were drawn from
        device = tokens.device
        # A layer: (tokens, parents (candidate index, -1 = root), log p-hat).
        layers = [(tokens, torch.full_like(tokens, -1), scores)]
        offset, e_prev = 0, 0.0  # offset = candidate index of the last layer's first node
        gains = []  # on the device: () per layer, E_d - E_(d-1)
        # Layers are expanded whole and in order, so an expanded candidate's drafter slot is its index.
        for depth in range(1, max_depth + 1):
            best = torch.cat([layer[2] for layer in layers]).topk(min(n, sum(layer[0].shape[0] for layer in layers)))
            e_depth = best.values.exp().sum()  # () E(A) of the best tree this deep
            if depth == max_depth:
                break
            if not self.stop_on_device:
                e_depth = float(e_depth)  # the layer's one read
                if e_depth - e_prev <= self.delta:
                    break
            else:
                gains.append(e_depth - e_prev)
            e_prev = e_depth
            tokens, parents, scores = layers[-1]
            if top:
                child_tokens, child_scores = drafter.expand_top(tokens, parents, n)  # (k, k')
                child_scores = scores[:, None] + child_scores
            else:
                dist = picker.log_dist(drafter.expand(tokens, parents))  # (k, V)
                if picker.sampled:
                    probs.append(dist.exp())
                # only a row's n best children can make the layer's n best
                child_tokens, child_scores = picker.ranked(scores, dist, n)
            child_tokens, child_scores = child_tokens.flatten(), child_scores.flatten()
            scores, flat = child_scores.topk(min(n, child_scores.shape[0]))
            width = child_tokens.shape[0] // tokens.shape[0]
            layers.append((child_tokens[flat], offset + flat // width, scores))
            offset += tokens.shape[0]
        sizes = [layer[0].shape[0] for layer in layers]
        candidates = torch.arange(sum(sizes), device=device)
        slots = torch.where(candidates < offset, candidates, -1)  # the last layer was never run
        depths = torch.cat([torch.full((size,), d + 1, device=device) for d, size in enumerate(sizes)])
        tokens, parents, scores = (torch.cat([layer[i] for layer in layers]) for i in range(3))
        keys = scores
        if gains:  # the host-side rule, on the device: layers past the first small gain are masked out
            small = torch.stack(gains) <= self.delta  # (L - 1,): [d - 1] = stop before drafting layer d + 1
            stop = torch.where(small.any(), small.long().argmax() + 1, len(layers))  # () layers kept
            keys = scores.masked_fill(depths > stop, float("-inf"))
        if top:  # a listed row may be short (-inf): those candidates are no children
            return select_best(tokens, parents, depths, keys, slots, n, keys=keys)
        if not picker.sampled:  # masked past the stop
            return select_best(tokens, parents, depths, keys, slots, n)
        probs.append(dist.new_zeros(sum(sizes) - offset, dist.shape[1]))  # the last layer drew nothing
        return select_best(tokens, parents, depths, scores, slots, n, keys=keys, probs=torch.cat(probs))
