"""Building draft trees: the helpers the tree policies share.

A shape is a list of paths of child ranks: (0, 2) is "the 3rd-ranked child of the 1st-ranked child
of the root". `ChildPicker` decides how a node's children come from its draft distribution (top-ranked,
or drawn without replacement). A tree whose shape is known before drafting (`static`, `sequoia`, and the
sampled trees of `opt` and `eagle2`, fixed by draw ranks) is laid out once on the host (`TreePlan`, one
per depth limit: `TreePlans`) and filled with tokens each step (`grow`): one drafter forward per layer over
the nodes that have children, nothing read back. `ranked_paths`, `layered_paths` and `kary_paths` make
path lists; `check_paths` checks one, `valued_paths` gives its nodes their p-hat.

`select_best` keeps the best-scored candidates of a tree grown candidate by candidate, for `opt` and
`eagle2` with top-ranked children (their shape depends on the draft's scores). `dyspec` uses `ChildPicker`."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ...settings.config import SpecConfig
from ..drafters import Drafter
from ..sampling import draw_distinct, inverse_cdf, policy_generator, sample_without_replacement, warp_logits
from ..tree import DraftTree

Path = tuple[int, ...]

# acc[k] = P(a node's (k+1)-th sampled child is the one accepted), when no calibration measured it (Sequoia's
# tree; the p-hat of sampled children); of the form measured on the shipped pair at T=1: 0.66, 0.10, 0.06, 0.04, ...
DEFAULT_ACCEPTANCE = (0.7, 0.1, 0.05, 0.025, 0.015, 0.01, 0.005, 0.005)


def rank_log_acceptance(acc: Sequence[float], width: int) -> list[float]:
    """The log of acc by rank for `width` ranks, made strictly decreasing (each at most 0.999 of the one before;
    ranks past the vector halve): siblings never tie, so ranking by value keeps them in draw order."""
    values, last = [], 1.0
    for k in range(width):
        value = min(acc[k] if k < len(acc) else last / 2, 0.999 * last)
        values.append(max(value, 1e-30))
        last = values[-1]
    return [math.log(v) for v in values]


def check_paths(paths: Sequence[Sequence[int]]) -> list[Path]:
    """A tree shape given as paths of child ranks, checked: every path non-empty, ranks >= 0, and its parent path
    among the paths. Returns them as tuples, in the order given."""
    nodes = [tuple(int(r) for r in p) for p in paths]
    known = set(nodes)
    for p in nodes:
        if not p or min(p) < 0:
            raise ValueError(f"a tree path must be a non-empty list of ranks >= 0, got {list(p)}")
        if len(p) > 1 and p[:-1] not in known:
            raise ValueError(f"tree path {list(p)} has no parent path {list(p[:-1])}")
    return nodes


def valued_paths(paths: Sequence[Path], acceptance: Sequence[float], max_depth: int, vocab: int
                 ) -> list[tuple[Path, float]]:
    """A fixed shape's nodes for a `TreePlan`: the paths at most `max_depth` deep whose ranks a vocabulary of
    `vocab` tokens can fill (a path past it goes, and so its subtree), each with its log p-hat when its
    children are sampled: the sum along it of the log acceptance of each draw rank (`rank_log_acceptance`)."""
    kept = [p for p in paths if len(p) <= max_depth and max(p) < vocab]
    log_acc = rank_log_acceptance(acceptance, max((max(p) for p in kept), default=0) + 1)
    return [(p, sum(log_acc[r] for r in p)) for p in kept]


class ChildPicker:
    """How a node's children are taken from its draft distribution.

    Deterministic (temperature 0, or children="top"): the draft's top-ranked tokens, in rank order.
    Sampled (temperature > 0 and children="sampled", or "auto" for a policy that samples by default):
    successive draws without replacement from q = the draft's distribution warped like the target's
    (the same warpers: `config.warp`); the tree then carries q for recursive rejection sampling, which
    needs exactly the distribution the children were drawn from. A sampled child's p-hat is its parent's
    times the acceptance of its draw rank (`config.acceptance`, calibrated, else DEFAULT_ACCEPTANCE).
    """

    def __init__(self, config: SpecConfig, sampled: bool):
        chosen = {"auto": sampled, "top": False, "sampled": True}[config.children]
        self.sampled = chosen and config.temperature > 0
        self.warp = config.warp
        self.seed = config.seed
        self.acceptance = config.acceptance or DEFAULT_ACCEPTANCE
        self.generator: torch.Generator | None = None  # made on the drafter's device at the first draw

    def log_dist(self, logq: torch.Tensor) -> torch.Tensor:
        """(R, V) draft log-probabilities -> (R, V) log of the distribution children come from (at temperature
        1 with no filter: the draft's own, already normalised)."""
        if not self.sampled:
            return logq
        if self.warp.identity:
            return logq.float()
        return warp_logits(logq, self.warp).log_softmax(dim=-1)

    def probs(self, logq: torch.Tensor) -> torch.Tensor:
        """(R, V) draft log-probabilities -> (R, V) the distribution sampled children are drawn from (`log_dist`,
        exponentiated: the softmax of the warped scores, one op fewer)."""
        if self.warp.identity:
            return logq.float().exp()
        return warp_logits(logq, self.warp).softmax(dim=-1)

    def generator_on(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = policy_generator(self.seed, device)
        return self.generator

    def pick(self, log_dist: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, V) -> children tokens (R, k') in rank / draw order and valid (R, k'), k' = min(k, V)."""
        if self.sampled:
            return sample_without_replacement(log_dist, k, self.generator_on(log_dist.device))
        tokens = log_dist.topk(min(k, log_dist.shape[-1]), dim=-1).indices
        return tokens, torch.ones_like(tokens, dtype=torch.bool)

    def ranked(self, scores: torch.Tensor, log_dist: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's k best children for a policy that keeps the best nodes by p-hat (opt, eagle2), when children
        are top-ranked: the top-ranked tokens, p-hat = the path's draft probability (a top child is accepted with
        about its probability). scores: (R,) the parents' log p-hat; log_dist: (R, V) from `log_dist`. Returns
        children (tokens, log p-hat), each (R, k'), in rank order. (Sampled children's p-hat is the acceptance of
        their draw rank, which makes the tree the same every step: `TreePlans`.)"""
        assert not self.sampled, "sampled trees are fixed by draw ranks: `TreePlans` / `grow`"
        child_scores, tokens = log_dist.topk(min(k, log_dist.shape[-1]), dim=-1)
        return tokens, scores[:, None] + child_scores


def root_children(log_dist: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The root's k best children when children are top-ranked, as `ChildPicker.ranked` gives a row's (the root's
    p-hat is 1): (tokens, log p-hat), each (k',), k' = min(k, V). log_dist: (V,) the root's draft log-probabilities."""
    scores, tokens = log_dist.topk(min(k, log_dist.shape[-1]))
    return tokens, scores


@dataclass(frozen=True)
class PlanLayer:
    """One layer of a `TreePlan`: its nodes are tree indices start .. start + L - 1."""

    start: int
    rows: torch.Tensor  # (L,) long: the parent's row among the previous layer's run nodes (the root's: 0)
    ranks: torch.Tensor  # (L,) long: the node's rank (top-ranked children) or draw rank among its siblings
    width: int  # children taken per row: the most any parent of this layer has
    parents: torch.Tensor  # (L,) long: tree index of the parent, -1 = the root
    run: torch.Tensor  # (K,) long: the layer's nodes (0-based in the layer) whose children come next, in slot order
    run_parent_slots: torch.Tensor  # (K,) long: the drafter slot of each run node's parent, -1 = the root


@dataclass(frozen=True)
class TreePlan:
    """A fixed tree shape laid out for `grow`, made once on the host: which rows each layer takes its children
    from, which nodes run through the drafter (the ones with children, slots in that order), and what the
    tree's tensors are. `prob_rows`: (N + 1,) the row of the distributions drawn from ([root] + the run nodes,
    then one zero row) that each of [root] + nodes carries in `draft_probs` (sampled children)."""

    layers: tuple[PlanLayer, ...]
    parents: torch.Tensor  # (N,)
    depths: torch.Tensor  # (N,)
    keys: torch.Tensor  # (N,) float: log p-hat of sampled children
    slots: torch.Tensor  # (N,) drafter slot, -1 for a node never run
    prob_rows: torch.Tensor  # (N + 1,)
    chain: bool  # the nodes are one chain of first draws: (0,), (0, 0), ...

    @staticmethod
    def make(nodes: Sequence[tuple[Path, float]], device: torch.device) -> "TreePlan":
        """nodes: (path, log p-hat), a tree (every path's parent among them)."""
        nodes = sorted(nodes, key=lambda node: (len(node[0]), node[0]))  # by depth, siblings in rank order
        paths = [path for path, _ in nodes]
        index = {path: i for i, path in enumerate(paths)}
        has_children = {path[:-1] for path in paths}
        runs: list[Path] = [()]  # [root] + the nodes run through the drafter, in slot order
        layers = []
        for depth in range(1, max((len(p) for p in paths), default=0) + 1):
            layer = [p for p in paths if len(p) == depth]
            row_of = {path: row for row, path in enumerate(p for p in runs if len(p) == depth - 1)}
            run = [i for i, p in enumerate(layer) if p in has_children]
            long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
            layers.append(PlanLayer(
                start=index[layer[0]], rows=long([row_of[p[:-1]] for p in layer]), ranks=long([p[-1] for p in layer]),
                width=max(p[-1] for p in layer) + 1, parents=long([index.get(p[:-1], -1) for p in layer]),
                run=long(run), run_parent_slots=long([runs.index(layer[i][:-1]) - 1 for i in run])))
            runs += [layer[i] for i in run]
        slot = {path: s - 1 for s, path in enumerate(runs)}
        return TreePlan(
            layers=tuple(layers),
            parents=torch.tensor([index.get(p[:-1], -1) for p in paths], dtype=torch.long, device=device),
            depths=torch.tensor([len(p) for p in paths], dtype=torch.long, device=device),
            keys=torch.tensor([v for _, v in nodes], dtype=torch.float32, device=device),
            slots=torch.tensor([slot.get(p, -1) for p in paths], dtype=torch.long, device=device),
            prob_rows=torch.tensor([slot.get(p, len(runs) - 1) + 1 for p in [()] + paths], dtype=torch.long,
                                   device=device),
            chain=bool(paths) and paths == [(0,) * depth for depth in range(1, len(paths) + 1)])


def grow(drafter: Drafter, logq: torch.Tensor, plan: TreePlan, picker: ChildPicker) -> DraftTree:
    """Fill `plan` with tokens, from `logq` (1, V) the root's distribution (`picker.log_dist`): per layer each
    row's children (as many as the row's most-ranked child needs: its top-ranked tokens, or draws without
    replacement), and the nodes with children run through the drafter, one forward a layer. Top-ranked
    children score their path's draft log-probability; sampled ones their plan's p-hat, and a draw a row
    could not make (a peaked q) leaves its node undrawn (key -inf, never tried by rejection sampling) and so
    its subtree. Nothing is read back."""
    device, sampled = logq.device, picker.sampled
    n = plan.parents.shape[0]
    tokens = torch.zeros(n, dtype=torch.long, device=device)
    valid = torch.ones(n + 1, dtype=torch.bool, device=device)  # [root] + nodes: drawn, with every ancestor
    scores = torch.zeros(n + 1, device=device)  # [root] + nodes: log q of the path (top-ranked children)
    dists = [logq.exp() if sampled else logq]  # [root] + the run nodes' distributions, (1 + K, V) in all
    for layer in plan.layers:
        end = layer.start + layer.rows.shape[0]
        if sampled:
            drawn, ok = draw_distinct(dists[-1], layer.width, picker.generator_on(device))  # (R, k)
            valid[layer.start + 1 : end + 1] = ok[layer.rows, layer.ranks] & valid[layer.parents + 1]
        else:
            child_scores, drawn = dists[-1].topk(layer.width, dim=-1)  # (R, k): the plan's ranks are < V
            scores[layer.start + 1 : end + 1] = scores[layer.parents + 1] + child_scores[layer.rows, layer.ranks]
        tokens[layer.start:end] = drawn[layer.rows, layer.ranks]
        if layer.run.shape[0]:
            nodes = tokens[layer.start:end][layer.run]  # (K,) the layer's nodes that get children
            log_dist = picker.log_dist(drafter.expand(nodes, layer.run_parent_slots))  # (K, V)
            dists.append(log_dist.exp() if sampled else log_dist)  # (K, V)
    if not sampled:
        return DraftTree(tokens, plan.parents, plan.depths, scores[1:], plan.slots)
    dists.append(dists[0].new_zeros(1, dists[0].shape[1]))  # the leaves' row: nothing drawn from it
    keys = plan.keys.masked_fill(~valid[1:], float("-inf"))
    return DraftTree(tokens, plan.parents, plan.depths, keys, plan.slots, torch.cat(dists)[plan.prob_rows], keys,
                     chain=plan.chain)


def grow_chain(drafter: Drafter, root: torch.Tensor, plan: TreePlan, picker: ChildPicker) -> DraftTree:
    """`grow` for a chain plan (`plan.chain`) and a drafter that `extends_chains`: node i + 1 is node i's first child,
    drafted as plain next-token decoding, a handful of ops a node. root: (1, V) the root's draft log-probabilities.
    Sampled: x_(i+1) drawn from q_i = `picker.probs` of the draft after x_1 .. x_i (one draw, the inverse of the
    cumulative sum), the rows kept for verification; a draw a row could not make (no mass) leaves its node and the
    rest undrawn (key -inf). Top-ranked: the draft's most likely token, scored by the path's log-probability. Nothing
    is read back."""
    n = plan.parents.shape[0]
    if not picker.sampled:
        best, tokens = [], []
        logq = root
        for i in range(n):
            value, token = logq.max(dim=-1)  # (1,), (1,)
            best.append(value)
            tokens.append(token)
            if i + 1 < n:
                logq = drafter.extend(token)  # (1, V)
        return DraftTree(torch.cat(tokens), plan.parents, plan.depths, torch.cat(best).cumsum(0), plan.slots)
    generator = picker.generator_on(root.device)
    rows, drawn = [picker.probs(root)], []  # (1, V) each: [root] + the nodes with a child
    for i in range(n):
        drawn.append(inverse_cdf(rows[-1], 1, generator)[0])  # (1,): V for a row without mass
        if i + 1 < n:
            rows.append(picker.probs(drafter.extend(drawn[-1].clamp(max=rows[-1].shape[1] - 1))))
    tokens = torch.cat(drawn)  # (N,)
    vocab = rows[0].shape[1]
    keys = plan.keys.masked_fill((tokens == vocab).cumsum(0) > 0, float("-inf"))  # (N,)
    rows.append(rows[0].new_zeros(1, vocab))  # the leaf's row: nothing drawn from it
    return DraftTree(tokens.clamp(max=vocab - 1), plan.parents, plan.depths, keys, plan.slots, torch.cat(rows), keys,
                     chain=True)


class TreePlans:
    """A policy's `TreePlan`s, one per depth limit, vocabulary and device, made on first use from
    `nodes(max_depth, vocab)`: the tree's (path, log p-hat), its ranks below `vocab`."""

    def __init__(self, nodes):
        self.nodes = nodes
        self.plans: dict[tuple, TreePlan] = {}

    def __call__(self, max_depth: int, root: torch.Tensor) -> TreePlan:
        """root: (1, V) the root's distribution (its width and device)."""
        key = (max_depth, root.shape[1], root.device)
        if key not in self.plans:
            self.plans[key] = TreePlan.make(self.nodes(max_depth, root.shape[1]), root.device)
        return self.plans[key]

    def grow(self, drafter: Drafter, committed: torch.Tensor, max_depth: int, picker: ChildPicker) -> DraftTree:
        """A policy's step: the root through the drafter, then its plan for `max_depth` filled (`grow`)."""
        root = drafter.root(committed)[None]  # (1, V)
        plan = self(max_depth, root)
        if plan.chain and drafter.extends_chains:  # each node the last one's child: plain next-token steps
            return grow_chain(drafter, root, plan, picker)
        return grow(drafter, picker.log_dist(root), plan, picker)


def ranked_paths(weights: Sequence[float], n: int, max_depth: int) -> list[Path]:
    """The n paths with the largest product of `weights[rank]` along them (at most max_depth deep),
    best first, ties to the shallower path. `weights` must be non-increasing and below 1, so a
    path always comes after its parent and after its lower-ranked sibling."""
    weights = [float(w) for w in weights]
    assert all(0 < w < 1 for w in weights) and weights == sorted(weights, reverse=True)
    heap = [(-weights[0], 1, (0,))]  # (-value, depth, path): candidates whose parent is taken
    paths: list[Path] = []
    while heap and len(paths) < n:
        neg_value, depth, path = heapq.heappop(heap)
        paths.append(path)
        if path[-1] + 1 < len(weights):  # the next sibling
            sibling = path[:-1] + (path[-1] + 1,)
            heapq.heappush(heap, (neg_value / weights[path[-1]] * weights[path[-1] + 1], depth, sibling))
        if depth < max_depth:  # the first child
            heapq.heappush(heap, (neg_value * weights[0], depth + 1, path + (0,)))
    return paths


def layered_paths(widths: Sequence[int], weights: Sequence[float]) -> list[Path]:
    """A tree with `widths[d]` nodes at depth d + 1: each layer takes the best children of the layer
    above, a path valued by the product of `weights[rank]` along it. Returned best first (so every
    prefix of the list is a tree), ties to the shallower path."""
    values: dict[Path, float] = {(): 1.0}
    layer: list[Path] = [()]
    for width in widths:
        children = [(values[p] * w, p + (r,)) for p in layer for r, w in enumerate(weights)]
        children.sort(key=lambda c: (-c[0], c[1]))
        layer = [p for _, p in children[:width]]
        values.update({p: v for v, p in children[:width]})
    del values[()]
    return sorted(values, key=lambda p: (-values[p], len(p), p))


def kary_paths(k: int, n: int, max_depth: int) -> list[Path]:
    """The first n paths of the complete k-ary tree of depth max_depth, breadth first."""
    paths: list[Path] = []
    layer: list[Path] = [()]
    for _ in range(max_depth):
        layer = [p + (r,) for p in layer for r in range(k)]
        paths += layer[: n - len(paths)]
        if len(paths) >= n:
            break
    return paths


def select_best(
    tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor, slots: torch.Tensor, n: int,
    listed: bool = False, draft_probs: torch.Tensor | None = None, depth_bound: int = 0,
) -> DraftTree:
    """The n candidates with the largest score (log p-hat), ties to the earlier (shallower) one.

    Candidates (C,) must be sorted by depth, with `parents` indexing candidates (-1 = root). As a
    child never has a larger score than its parent, the chosen set is a connected tree containing the root.
    `listed`: the candidates come from a drafter that lists its children (`top_children`) and may pad its short
    rows with -inf (not `full_top_rows`): those are never chosen (a shape sync). Otherwise candidates scored
    -inf (past a stop decided on the device) fill the n after every finite one: a fixed size.
    `draft_probs` (C + 1, V): the distributions sampled children were drawn from ([root] + candidates); the tree
    then carries the chosen rows, and its scores as keys (-inf: not a draw, never tried by rejection sampling).
    `depth_bound`: no candidate is deeper (0: not known), for the tree's `depth_bound`.
    """
    order = torch.sort(scores, descending=True, stable=True).indices[:n]
    if listed:
        order = order[scores[order] > float("-inf")]  # a shape sync
    chosen = order.sort().values  # (n,) back in candidate (= depth) order
    up = parents[chosen]  # (n,) each chosen candidate's parent candidate, chosen before it (-1 = the root)
    tree_parents = torch.searchsorted(chosen, up).masked_fill_(up < 0, -1)  # (n,) its index among the chosen
    if draft_probs is None:
        return DraftTree(tokens[chosen], tree_parents, depths[chosen], scores[chosen], slots[chosen],
                         depth_bound=depth_bound)
    rows = torch.cat([chosen.new_zeros(1), chosen + 1])  # [root] + the chosen candidates
    return DraftTree(tokens[chosen], tree_parents, depths[chosen], scores[chosen], slots[chosen], draft_probs[rows],
                     scores[chosen], depth_bound=depth_bound)
