"""OPT-Tree: the tree of `budget` nodes maximising E(A) = sum of p-hat, built layer by layer.

The n nodes with the largest p-hat over all candidates form the optimal tree, and the candidates
of layer d + 1 need only be the n best children of layer d. Deepening stops once the best
n-node tree gains no more than `delta` expected tokens, decided before the next draft forward.

Where that decision is made: on the host (the default, every device), reading each layer's scores and
parents before the next draft forward, so no forward is wasted (the host then picks the tree too and makes
its verify mask, where the device would sort and index); or on the device (`stop_on_device`: every layer
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
import os
from typing import Sequence

import numpy as np
import torch

from ...settings.config import SpecConfig
from ...device import constant, host_tensor
from ..drafters import Drafter
from ..tree import DraftTree
from .registry import register_policy
from .shapes import ChildPicker, Path, TreePlans, rank_log_acceptance, root_children, select_best


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


def lists_on_host() -> bool:
    """Whether a drafter that can list its children on the host does (`OptTree._build_listed_on_host`): always, but
    where `OPTTREE_LISTED=device` asks for its tensors' answers (`root_top` / `expand_top`), as tests do to count a
    step as a GPU runs it."""
    return os.environ.get("OPTTREE_LISTED", "host") != "device"


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
        max_depth, picker = min(self.max_depth, depth_limit), self.picker
        if picker.sampled:  # the tree is fixed by draw ranks (module docstring): drawn into its plan
            return self.plans.grow(drafter, committed, max_depth, picker)
        if self.stop_on_device:
            return self._build_stop_on_device(drafter, committed, max_depth)
        if drafter.lists_on_host and lists_on_host():
            return self._build_listed_on_host(drafter, committed, max_depth)
        return self._build_stop_on_host(drafter, committed, max_depth)

    def _first_layer(self, drafter: Drafter, committed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The root's n best children: (tokens, log p-hat), each (k,)."""
        if drafter.top_children:  # the drafter lists each node's best children itself
            return drafter.root_top(committed, self.n)
        return root_children(drafter.root(committed), self.n)

    def _children(self, drafter: Drafter, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The next layer: the n best children of a layer's nodes (tokens, parent slots, log p-hat (k,) each), as
        (tokens, log p-hat, index among the (k, k') children, k'); only a row's n best children can make them."""
        if drafter.top_children:
            child_tokens, child_scores = drafter.expand_top(tokens, parents, self.n)  # (k, k')
            child_scores = scores[:, None] + child_scores
        else:
            child_tokens, child_scores = self.picker.ranked(scores, drafter.expand(tokens, parents), self.n)
        width = child_tokens.shape[1]
        child_scores, flat = child_scores.view(-1).topk(min(self.n, child_scores.numel()))
        return child_tokens.take(flat), child_scores, flat, width  # take: of the flattened (k, k')

    def _build_stop_on_host(self, drafter: Drafter, committed: torch.Tensor, max_depth: int) -> DraftTree:
        """Layer by layer, each layer's scores and parents read by the host (a read a layer), which decides the stop
        and then the tree: the n best candidates, their parents and depths known on the host, sent in one copy."""
        n = self.n
        tokens, scores = self._first_layer(drafter, committed)  # layer 1, (k,)
        device = tokens.device
        parents = constant((-1,) * tokens.shape[0], device)  # (k,) the layer's parents' slots
        layers = [(tokens, scores)]
        # on the host, by candidate (layers in order): log p-hat, parent candidate (-1 = the root), depth
        values, up, depths = scores.tolist(), [-1] * tokens.shape[0], [1] * tokens.shape[0]  # layer 1's read
        offset, e_prev = 0, 0.0  # offset = candidate index of the last layer's first node
        # Layers are expanded whole and in order, so an expanded candidate's drafter slot is its index.
        for depth in range(1, max_depth):
            e_depth = sum(math.exp(v) for v in heapq.nlargest(n, values))  # E(A) of the best tree this deep
            if e_depth - e_prev <= self.delta:
                break
            e_prev = e_depth
            tokens, scores, flat, width = self._children(drafter, tokens, parents, scores)
            parents = offset + flat // width  # (k,) candidate indices = slots
            read = torch.stack([scores, flat.to(scores.dtype)]).tolist()  # the layer's one read
            values += read[0]
            up += [offset + int(f) // width for f in read[1]]
            offset = len(depths)
            depths += [depth + 1] * len(read[0])
            layers.append((tokens, scores))
        chosen, tree_parents = self._chosen(values, up, drafter.top_children and not drafter.full_top_rows)
        pick, tree_parents_t, tree_depths, slots = host_tensor(  # (4, n) in one copy
            [chosen, tree_parents, [depths[c] for c in chosen], [c if c < offset else -1 for c in chosen]],
            device).unbind()
        tokens, scores = (torch.cat([layer[i] for layer in layers])[pick] for i in range(2))
        return DraftTree(tokens, tree_parents_t, tree_depths, scores, slots, host_parents=tuple(tree_parents))

    def _build_listed_on_host(self, drafter: Drafter, committed: torch.Tensor, max_depth: int) -> DraftTree:
        """`_build_stop_on_host` for a drafter that lists its children on the host (`lists_on_host`: NumPy, its state
        on the CPU): the same candidates, values (float32 sums) and rule, a few array operations a layer instead of a
        dozen tensor ops: 0.32 against 0.72 ms a tree at budget 8 on a 2-core Xeon (`scripts/listed_children.py`).
        Candidates tied in value are taken in their order (where `topk` may take them in another)."""
        n = self.n
        tokens, scores = drafter.host_root_top(int(committed[-1]), n)  # layer 1, (k,) each
        listed_tokens, values, up, depths = [tokens], scores.tolist(), [-1] * len(tokens), [1] * len(tokens)
        offset, e_prev = 0, 0.0  # as `_build_stop_on_host`
        for depth in range(1, max_depth):
            e_depth = sum(math.exp(v) for v in heapq.nlargest(n, values))
            if e_depth - e_prev <= self.delta:
                break
            e_prev = e_depth
            child_tokens, child_scores = drafter.host_expand_top(tokens, depth, n)  # (k, k')
            width = child_tokens.shape[1]
            child_scores = (scores[:, None] + child_scores).ravel()
            flat = np.argsort(-child_scores, kind="stable")[:n]  # the layer's n best, ties in candidate order
            tokens, scores = child_tokens.ravel()[flat], child_scores[flat]
            listed_tokens.append(tokens)
            values += scores.tolist()
            up += (offset + flat // width).tolist()
            offset = len(depths)
            depths += [depth + 1] * len(flat)
        return self._listed_tree(listed_tokens, values, up, depths, offset, drafter.full_top_rows, committed.device)

    def _listed_tree(self, listed_tokens: list[np.ndarray], values: list[float], up: list[int], depths: list[int],
                     offset: int, full: bool, device: torch.device) -> DraftTree:
        """The tree of a build listed on the host, from its candidates (by layer: tokens; each one's log p-hat, parent
        candidate and depth; `offset`: the last layer's first, the candidates before it were expanded)."""
        chosen, tree_parents = self._chosen(values, up, not full)
        columns = [np.concatenate(listed_tokens)[chosen].tolist(), tree_parents, [depths[c] for c in chosen],
                   [c if c < offset else -1 for c in chosen]]  # tokens, parents, depths, slots
        tokens, tree_parents_t, tree_depths, slots = host_tensor(columns, device).unbind()  # (4, n) in one copy
        scores = [values[c] for c in chosen]  # float32 values
        return DraftTree(tokens, tree_parents_t, tree_depths, torch.tensor(scores, dtype=torch.float32, device=device),
                         slots, host_parents=tuple(tree_parents),
                         host_nodes=tuple(zip(columns[0], columns[1], columns[2], scores, columns[3])))

    def listed_together(self, drafter: Drafter) -> bool:
        """Whether `build` of this drafter's tree is what `build_listed_rows` makes: top-ranked children listed on the
        host, every row full (`full_top_rows`)."""
        return not self.picker.sampled and not self.stop_on_device and drafter.lists_on_host and lists_on_host() \
            and drafter.full_top_rows

    @staticmethod
    def build_listed_rows(builds: list[tuple["OptTree", Drafter, torch.Tensor, int]]) -> list[DraftTree]:
        """`build` of several rows' trees (policy, drafter, committed, depth limit), each `listed_together` through one
        lister (`host_lister`: Token Recycling's matrix, which a batch's rows share), under policies of one budget and
        delta: the rows' layers grown together, one listing and a few array operations a layer for all of them where
        `_build_listed_on_host` takes as many a row. The same trees as each row's own build: the same candidates in the
        same order, float32 values, stop (its sums in the same order, by `math.exp`) and choice. One row keeps its own
        loop: through this one its tree took 293-359 against 185-201 us (`scripts/listed_children.py`, budgets 4,
        16)."""
        first, lister = builds[0][0], builds[0][1].host_lister()
        n, delta = first.n, first.delta
        assert all(p.n == n and p.delta == delta and d.host_lister() is lister for p, d, _, _ in builds), \
            "rows listed together share a lister, a budget and a delta"
        max_depths = [min(p.max_depth, limit) for p, _, _, limit in builds]
        tokens, values = lister.host_top(np.array([int(c[-1]) for _, _, c, _ in builds]), 0, n)  # (R, k) layer 1
        alive = np.arange(len(builds))  # the rows still growing
        # each layer: (its rows, their tokens, log p-hat and parent candidates (-1 = the root)), (rows, width) each
        layers = [(alive, tokens, values, np.full(tokens.shape, -1))]
        held = [[(tokens[r], values[r], layers[0][3][r])] for r in range(len(builds))]  # each row's layers
        e_prev = [0.0] * len(builds)
        for depth in range(1, max(max_depths)):
            seen = np.concatenate([v[np.searchsorted(rows, alive)] for rows, _, v, _ in layers], axis=1)  # (A, C)
            best = (-np.sort(-seen, axis=1)[:, :n]).tolist()  # each row's n best values, largest first
            grows = []
            for i, r in enumerate(alive.tolist()):
                e_depth = sum(math.exp(v) for v in best[i])  # E(A) of its best tree this deep
                if depth < max_depths[r] and e_depth - e_prev[r] > delta:
                    e_prev[r] = e_depth
                    grows.append(i)
            if not grows:
                break
            alive, tokens, values = alive[grows], tokens[grows], values[grows]  # the growing rows' last layer (A, k)
            child_tokens, child_values = lister.host_top(tokens.ravel(), depth, n)  # (A k, k')
            width = child_tokens.shape[1]
            child_values = (values[:, :, None] + child_values.reshape(len(alive), -1, width)).reshape(len(alive), -1)
            flat = np.argsort(-child_values, axis=1, kind="stable")[:, :n]  # (A, n') each row's n best, ties in order
            parents = sum(layer[1].shape[1] for layer in layers[:-1]) + flat // width  # candidates of the last layer
            tokens = np.take_along_axis(child_tokens.reshape(len(alive), -1), flat, axis=1)
            values = np.take_along_axis(child_values, flat, axis=1)
            layers.append((alive, tokens, values, parents))
            for i, r in enumerate(alive.tolist()):
                held[r].append((tokens[i], values[i], parents[i]))
        trees = []
        for mine, (_, _, committed, _) in zip(held, builds):  # a row's candidates, layer by layer, as its own build's
            depths = [d + 1 for d, (tokens, _, _) in enumerate(mine) for _ in range(len(tokens))]
            trees.append(first._listed_tree([m[0] for m in mine], np.concatenate([m[1] for m in mine]).tolist(),
                                            np.concatenate([m[2] for m in mine]).tolist(), depths,
                                            len(depths) - len(mine[-1][0]), True, committed.device))
        return trees

    def _chosen(self, values: list[float], up: list[int], padded: bool) -> tuple[list[int], list[int]]:
        """The tree of the n best candidates by `values` (log p-hat; ties to the earlier, shallower one), given each
        candidate's parent candidate `up` (-1 = the root): (the chosen candidates in order, each one's parent among
        them). `padded`: candidates valued -inf are a listed row's padding, no children."""
        order = sorted(range(len(values)), key=lambda c: -values[c])[: self.n]
        if padded:
            order = [c for c in order if values[c] > float("-inf")]
        chosen = sorted(order)  # a tree: a child never scores above its parent, and comes after it
        index = {c: i for i, c in enumerate(chosen)}
        return chosen, [index[up[c]] if up[c] >= 0 else -1 for c in chosen]

    def _build_stop_on_device(self, drafter: Drafter, committed: torch.Tensor, max_depth: int) -> DraftTree:
        """Every layer up to max_depth drafted, nothing read back: the stop depth found from the gains on the device
        and deeper candidates masked out (module docstring)."""
        n = self.n
        tokens, scores = self._first_layer(drafter, committed)  # layer 1, (k,)
        device = tokens.device
        # A layer: (tokens, parents (candidate index, -1 = root), log p-hat).
        layers = [(tokens, torch.full_like(tokens, -1), scores)]
        offset, e_prev, gains = 0, 0.0, []  # gains: () per layer, E_d - E_(d-1), on the device
        for _ in range(1, max_depth):
            best = torch.cat([layer[2] for layer in layers]).topk(min(n, sum(layer[0].shape[0] for layer in layers)))
            e_depth = best.values.exp().sum()  # () E(A) of the best tree this deep
            gains.append(e_depth - e_prev)
            e_prev = e_depth
            tokens, parents, scores = layers[-1]
            tokens, scores, flat, width = self._children(drafter, tokens, parents, scores)
            layers.append((tokens, offset + flat // width, scores))
            offset += layers[-2][0].shape[0]
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
        listed = drafter.top_children and not drafter.full_top_rows
        return select_best(tokens, parents, depths, keys, slots, n, listed=listed, depth_bound=len(layers))
