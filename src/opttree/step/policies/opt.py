"""OPT-Tree: the tree of `budget` nodes maximising E(A) = sum of p-hat, built layer by layer.

The n nodes with the largest p-hat over all candidates form the optimal tree, and the candidates
of layer d + 1 need only be the n best children of layer d. Deepening stops once the best
n-node tree gains no more than `delta` expected tokens, decided before the next draft forward.

Where that decision is made: on the host (the default, every device), reading each layer's gain
before the next draft forward, so no forward is wasted; or on the device (`stop_on_device`: every layer
up to max_depth is drafted, the stop depth is found from the gains on the device and deeper candidates
are masked out, so nothing is read back until the acceptance). Both give the same tree, but where the stop
leaves fewer than n candidates (a drafter that lists few children a node, as Token Recycling does): the
device then fills the n nodes with candidates past the stop, a fixed size. The device stop
was meant for GPUs, where a read stalls the launch queue; measured on an H100 with both models' steps in
CUDA graphs (docs/BENCHMARKS.md), the host stop is the faster one there too: 11.3 against 16.3 ms a step
for `opt@16`, 12.6 against 20.5 ms for `recycling+lookup@16`. A read costs less than the layers it saves.

Sampling (temperature > 0), children="sampled" (the default, "auto"): a node's children are draws
without replacement from the draft's distribution warped like the target's, verified by recursive
rejection sampling, which accepts a child x with min(1, p(x) / q(x)) rather than p(x). A drawn child's
p-hat is then its parent's times the acceptance of its draw rank, and the tree is the n nodes with the
largest p-hat, with the same delta stop. Those p-hat never depend on what was drawn, so neither does the
tree: it is the same every step, found once on the host (`drawn_paths`, the same layer rule) and
filled with draws each step (`shapes.grow`): one draft forward a layer over only the nodes that get
children, nothing read back (against drafting every candidate of a layer, choosing the best and reading each
layer's gain: 0.6-0.8 ms less a step on a 2-core Xeon). Why that is exact: docs/METHODS.md, "OPT-Tree with
sampled children". children="top": the top-n tree, verified by matching.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import torch

from ...settings.config import SpecConfig
from ..drafters import Drafter
from ..tree import DraftTree
from .registry import register_policy
from .shapes import ChildPicker, Path, TreePlans, rank_log_acceptance, select_best


def drawn_paths(log_acc: Sequence[float], n: int, delta: float, max_depth: int) -> list[tuple[Path, float]]:
    """OPT-Tree's tree when every p-hat is a product of draw-rank acceptances (sampled children): (path, log
    p-hat) of its nodes, by depth, siblings in rank order. `log_acc`: strictly decreasing logs by rank (as
    `rank_log_acceptance` makes them), one per child a node can have. The same rule as the layer-by-layer
    build: layer d + 1 holds the n best children of layer d; deepening stops at max_depth or once the n best
    nodes so far gain no more than `delta` over the layer before; the tree is the n best of all layers (ties
    to the shallower, then earlier, node). A child is strictly worse than its parent and than its
    lower-ranked sibling, so those n nodes are a tree."""
    layer: list[tuple[Path, float]] = [((r,), value) for r, value in enumerate(log_acc[:n])]
    candidates, e_prev = list(layer), 0.0
    for depth in range(1, max_depth):
        e_depth = sum(math.exp(v) for v in heapq.nlargest(n, (v for _, v in candidates)))
        if e_depth - e_prev <= delta:
            break
        e_prev = e_depth
        children = [(path + (r,), value + child) for path, value in layer for r, child in enumerate(log_acc)]
        layer = sorted(children, key=lambda c: -c[1])[:n]  # stable: ties to the earlier parent, the lower rank
        candidates += layer
    best = sorted(range(len(candidates)), key=lambda i: -candidates[i][1])[:n]  # stable: ties to the shallower
    return sorted((candidates[i] for i in best), key=lambda c: (len(c[0]), c[0]))


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
        # sampled children: the tree, fixed by draw ranks (module docstring)
        acceptance = self.picker.acceptance
        self.plans = TreePlans(lambda max_depth, vocab: drawn_paths(
            rank_log_acceptance(acceptance, min(self.n, vocab)), self.n, self.delta, max_depth))

    def build(self, drafter: Drafter, committed: torch.Tensor, depth_limit: int) -> DraftTree:
        n, max_depth, picker = self.n, min(self.max_depth, depth_limit), self.picker
        if picker.sampled:  # the tree is fixed by draw ranks (module docstring): drawn into its plan
            return self.plans.grow(drafter, committed, max_depth, picker)
        top = drafter.top_children  # the drafter lists each node's best children itself
        if top:
            tokens, scores = drafter.root_top(committed, n)  # layer 1, (k,)
        else:
            dist = drafter.root(committed)[None]  # (1, V)
            tokens, scores = (x[0] for x in picker.ranked(torch.zeros(1, device=dist.device), dist, n))  # layer 1, (k,)
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
            else:  # only a row's n best children can make the layer's n best
                child_tokens, child_scores = picker.ranked(scores, drafter.expand(tokens, parents), n)
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
        # a listed row may be padded (-inf): those candidates are no children; masked past the stop
        return select_best(tokens, parents, depths, keys, slots, n, listed=top and not drafter.full_top_rows)
