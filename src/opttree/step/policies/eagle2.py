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
sampling; those p-hat never depend on the draws, so the tree is the same every step, found once on the host
(`drawn_paths`) and filled with draws (`shapes.grow`), as OPT-Tree's is: only the nodes the tree gives
children run through the drafter, and no layer is drafted past the tree's depth.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ...settings.config import SpecConfig
from ...device import constant
from ..drafters import Drafter
from ..tree import DraftTree
from .registry import register_policy
from .shapes import ChildPicker, Path, TreePlans, rank_log_acceptance, root_children, select_best

MAX_TOP_K = 10


def top_k(budget: int) -> int:
    return max(2, min(MAX_TOP_K, math.ceil(math.sqrt(budget))))


def drawn_paths(log_acc: Sequence[float], n: int, k: int, depth: int) -> list[tuple[Path, float]]:
    """EAGLE-2's tree when every p-hat is a product of draw-rank acceptances: (path, log p-hat) of its nodes, by
    depth, siblings in rank order. The build's rule on the host: layer 1 = the root's k children, every later
    layer = the k children of each of the previous layer's k best, `depth` layers; the tree = the n best of all
    (ties to the shallower, then earlier). `log_acc`: strictly decreasing logs by rank, k of them (fewer where
    the vocabulary is smaller)."""
    layer: list[tuple[Path, float]] = [((r,), value) for r, value in enumerate(log_acc[:k])]
    candidates = list(layer)
    for _ in range(1, depth):
        expanded = sorted(layer, key=lambda c: -c[1])[:k]
        layer = [(path + (r,), value + child) for path, value in expanded for r, child in enumerate(log_acc[:k])]
        candidates += layer
    best = sorted(range(len(candidates)), key=lambda i: -candidates[i][1])[:n]
    return sorted((candidates[i] for i in best), key=lambda c: (len(c[0]), c[0]))


@register_policy("eagle2")
class Eagle2:
    needs_drafter = True
    sampled_keys = True

    def __init__(self, config: SpecConfig):
        self.n, self.depth, self.k = config.budget, config.max_depth, top_k(config.budget)
        self.picker = ChildPicker(config, sampled=True)  # at temperature > 0, as OPT-Tree (module docstring)
        acceptance = self.picker.acceptance
        self.plans = TreePlans(lambda depth, vocab: drawn_paths(
            rank_log_acceptance(acceptance, min(self.k, vocab)), self.n, self.k, depth))

    def build(self, drafter: Drafter, committed: torch.Tensor, depth_limit: int) -> DraftTree:
        picker, k = self.picker, self.k
        if picker.sampled:  # the tree is fixed by draw ranks (module docstring): drawn into its plan
            return self.plans.grow(drafter, committed, min(self.depth, depth_limit), picker)
        tokens, scores = root_children(drafter.root(committed), k)  # layer 1, (k,)
        device = tokens.device
        depth = min(self.depth, depth_limit)
        # Candidates are numbered layer by layer; a layer past the first is its expanded parents' children, row by
        # row, `width` a row, so candidate c of it is the child of the previous layer's expanded node c // width.
        layers = [(tokens, scores)]  # (tokens, log p-hat) of each layer's candidates
        expanded: list[torch.Tensor] = []  # per layer but the last, (e,) its expanded nodes' positions in the layer
        rows: list[int] = [0] * tokens.shape[0]  # per candidate: its parent's row in [root] + the expanded nodes
        offsets: list[int] = [0]  # per row of [root] + the expanded nodes: its layer's first candidate index
        for d in range(1, depth):
            e = min(k, scores.shape[0])
            expand = scores.topk(e).indices  # (e,) positions in the layer
            # the parents' slots (-1: the root): the rows of the previous layer's expanded nodes, less one
            parent_slots = constant(tuple(r - 1 for r in rows[-scores.shape[0]:]), device)[expand] if d > 1 \
                else constant((-1,) * e, device)
            dist = drafter.expand(tokens[expand], parent_slots)  # (e, V)
            tokens, scores = picker.ranked(scores[expand], dist, k)  # (e, w)
            width = tokens.shape[1]
            rows += [len(offsets) + c // width for c in range(e * width)]
            offsets += [sum(t.shape[0] for t, _ in layers) - layers[-1][0].shape[0]] * e
            expanded.append(expand)
            tokens, scores = tokens.view(-1), scores.view(-1)  # (e * w,)
            layers.append((tokens, scores))
        tokens, scores = (torch.cat([layer[i] for layer in layers]) for i in range(2))  # (C,)
        depths = constant(tuple(d + 1 for d, (t, _) in enumerate(layers) for _ in range(t.shape[0])), device)  # (C,)
        # [root] + the expanded nodes as candidate indices (the root: -1), in slot order
        nodes = torch.cat([constant((-1,), device), *expanded]) + constant(tuple(offsets), device)  # (1 + E,)
        parents = nodes[constant(tuple(rows), device)]  # (C,)
        slots = torch.full_like(tokens, -1).index_put_((nodes[1:],), constant(tuple(range(len(offsets) - 1)), device))
        return select_best(tokens, parents, depths, scores, slots, self.n, depth_bound=len(layers))
