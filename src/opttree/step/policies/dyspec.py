"""DySpec: dynamic greedy expansion, threshold form (one drafter forward per layer).

Every node has a value v, its estimated probability of being accepted (the root: 1). A node
keeps adding children while its value stays above the threshold; each added child x gets the
value v * q'(x) and the node's value becomes v * (1 - q'(x)), where q' is the draft distribution
renormalised over the tokens not yet taken. Along a node's children this telescopes: child i has
value v * q(x_i) (its p-hat) and the node offers child i + 1 while v * (1 - q(x_1) - ... - q(x_i))
exceeds the threshold. Layer by layer, the new children whose value exceeds the threshold are run
through the drafter together, and so on to max_depth. If a layer offers more children than the
budget has left, the best-valued offers win (a node's offers are taken in order).

Threshold = delta / budget: delta is OPT-Tree's smallest worthwhile gain in expected accepted
tokens, spread over the budget's nodes (delta = 0: no threshold, the budget alone stops growth).

Temperature 0: a node's children are the draft's top-ranked tokens (the greedy variant), verified
by token matching. Temperature > 0: children are successive draws without replacement from the
draft's distribution warped like the target's, and the tree carries those distributions for
recursive rejection sampling. Whether a node offers another child depends only on its earlier
children (never on the token about to be drawn), which keeps rejection sampling exact.

Where the growth is decided: on the host (the default), one read a layer (is any new child worth a
draft forward?) and the layer's nodes cut to those taken; or on the device (`grow_on_device`), in fixed
shapes with nothing read back: every layer holds `budget` slots (the best offers, those past the
threshold or the budget marked invalid), all of them run through the drafter, to max_depth; the same
nodes are valid as on the host, and the tree is the valid ones, filled to the budget with the first
layer's invalid slots (never drawn when sampling, so never tried; top-ranked candidates when not).
"""

from __future__ import annotations

import torch

from ...settings.config import SpecConfig
from ..drafters import Drafter
from ..tree import DraftTree
from .registry import register_policy
from .shapes import ChildPicker, select_best


@register_policy("dyspec")
class DySpec:
    needs_drafter = True
    sampled_keys = False

    grow_on_device = False  # where growth is decided (module docstring): the host, on every device

    def __init__(self, config: SpecConfig):
        self.n, self.max_depth = config.budget, config.max_depth
        self.threshold = config.delta / config.budget
        self.picker = ChildPicker(config, sampled=True)  # top-ranked children at temperature 0

    def build(self, drafter: Drafter, committed: torch.Tensor, depth_limit: int) -> DraftTree:
        max_depth = min(self.max_depth, depth_limit)
        if self.grow_on_device:
            return self._grow_fixed(drafter, committed, max_depth)
        dists = self.picker.log_dist(drafter.root(committed)[None])  # (F, V) of the frontier
        device = dists.device
        frontier = torch.full((1,), -1, dtype=torch.long, device=device)  # (F,) tree index of the frontier nodes, -1 = root
        value = torch.zeros(1, device=device)  # (F,) log value of the frontier nodes
        tokens, parents, depths, scores, slots = [], [], [], [], []
        probs, prob_nodes = [dists.exp()], [frontier]
        size = next_slot = 0
        for depth in range(1, max_depth + 1):
            room = self.n - size
            chosen, logq, offer = self._offers(dists, value, room)  # (F, k) each
            order = offer.flatten().sort(descending=True, stable=True).indices[:room]
            take = torch.zeros(offer.numel(), dtype=torch.bool, device=device)
            take[order] = offer.flatten()[order] > float("-inf")
            row, rank = take.view_as(offer).nonzero(as_tuple=True)  # by parent, then draw order
            if row.numel() == 0:
                break
            child_score = value[row] + logq[row, rank]  # log p-hat = log of the child's value
            tokens.append(chosen[row, rank])
            parents.append(frontier[row])
            depths.append(torch.full_like(row, depth))
            scores.append(child_score)
            index = torch.arange(size, size + row.numel(), device=device)  # tree indices of the new children
            size += row.numel()
            expand = (child_score.exp() > self.threshold) & (depth < max_depth) & (size < self.n)
            child_slots = torch.full_like(row, -1)
            deeper = bool(expand.any())  # the layer's one read: is any child worth a draft forward
            if deeper:
                run = expand.nonzero().squeeze(1)
                parent_tree = frontier[row[run]]
                parent_slots = torch.where(parent_tree >= 0, torch.cat(slots + [child_slots])[parent_tree.clamp(min=0)], -1)
                dists = self.picker.log_dist(drafter.expand(tokens[-1][run], parent_slots))  # (F', V)
                child_slots[run] = torch.arange(next_slot, next_slot + run.numel(), device=device)
                next_slot += run.numel()
                frontier, value = index[run], child_score[run]
                probs.append(dists.exp())
                prob_nodes.append(frontier)
            slots.append(child_slots)
            if not deeper:
                break
        if not tokens:
            return DraftTree.empty(device)
        draft_probs = None
        if self.picker.sampled:
            draft_probs = torch.zeros(size + 1, dists.shape[1], device=device)  # (N + 1, V), zero rows for leaves
            draft_probs[torch.cat(prob_nodes) + 1] = torch.cat(probs)
        return DraftTree(torch.cat(tokens), torch.cat(parents), torch.cat(depths), torch.cat(scores),
                         torch.cat(slots), draft_probs)

    def _offers(self, dists: torch.Tensor, value: torch.Tensor, k: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The frontier's next k children (`dists` (F, V), `value` (F,) log values): (tokens, log q, log value
        offering each), (F, k') each in draw order; an offer is -inf where the child cannot be drawn or its offer
        does not pass the threshold. A child's offer is its parent's value times the draft mass its earlier
        siblings left (module docstring): it never looks at the child's own token."""
        chosen, ok = self.picker.pick(dists, k)  # (F, k') in draw order
        logq = dists.gather(1, chosen).masked_fill(~ok, float("-inf"))  # (F, k')
        taken_before = logq.exp().cumsum(dim=1) - logq.exp()  # (F, k') draft mass of the earlier siblings
        offer = value[:, None] + (1 - taken_before).clamp(min=0).log()  # (F, k')
        return chosen, logq, offer.masked_fill(~ok | (offer.exp() <= self.threshold), float("-inf"))

    def _grow_fixed(self, drafter: Drafter, committed: torch.Tensor, max_depth: int) -> DraftTree:
        """`build` in fixed shapes, nothing read back (module docstring). Candidates are numbered layer by layer;
        layer d holds the n best offers of the previous layer's slots (the root's for d = 1), in parent then draw
        order, each valid where its offer passes the threshold and the budget still has room; every slot but the
        last layer's runs through the drafter (its drafter slot is its candidate index), and offers children only
        where it is valid and its value passes the threshold."""
        n = self.n
        dists = self.picker.log_dist(drafter.root(committed)[None])  # (F, V), F = 1 (the root), then a layer's slots
        device = dists.device
        value = torch.zeros(1, device=device)  # (F,) log value of the frontier (-inf: offers no child)
        frontier = torch.full((1,), -1, dtype=torch.long, device=device)  # (F,) candidate index, -1 = the root
        size = torch.zeros((), dtype=torch.long, device=device)  # valid candidates so far
        sampled = self.picker.sampled
        tokens, parents, depths, keys = [], [], [], []
        probs = [dists.exp()] if sampled else []  # the distributions children were drawn from (sampled only)
        for depth in range(1, max_depth + 1):
            chosen, logq, offer = self._offers(dists, value, n)  # (F, k) each
            k, offer = chosen.shape[1], offer.flatten()  # (F k,)
            best = offer.sort(descending=True, stable=True).indices[:n]  # (L,) the best offers, best first
            room = torch.arange(best.shape[0], device=device) < n - size
            take = torch.zeros_like(offer, dtype=torch.bool).index_put_((best,), (offer[best] > float("-inf")) & room)
            slot = best.sort().values  # (L,) by parent, then draw order
            row, rank, valid = slot // k, slot % k, take[slot]
            score = torch.where(valid, value[row] + logq[row, rank], float("-inf"))  # (L,) log p-hat; -inf: not a node
            size = size + valid.sum()
            first = sum(t.shape[0] for t in tokens)  # candidate index of the layer's first slot
            tokens.append(chosen[row, rank])
            parents.append(frontier[row])
            depths.append(torch.full_like(row, depth))
            keys.append(score)
            if depth == max_depth:
                break
            frontier = torch.arange(first, first + row.shape[0], device=device)
            dists = self.picker.log_dist(drafter.expand(tokens[-1], parents[-1]))  # (L, V); parent slot = its index
            value = torch.where(valid & (score.exp() > self.threshold) & (size < n), score, float("-inf"))
            if sampled:
                probs.append(dists.exp())
        layers = len(tokens)
        tokens, parents, depths, keys = (torch.cat(x) for x in (tokens, parents, depths, keys))
        run = torch.arange(tokens.shape[0], device=device)
        slots = torch.where(run < tokens.shape[0] - row.shape[0], run, -1)  # the last layer never ran
        draft_probs = None
        if sampled:  # (C + 1, V): [root] + every candidate's distribution, zero rows for the last layer
            draft_probs = torch.cat([*probs, probs[0].new_zeros(row.shape[0], probs[0].shape[1])])
        return select_best(tokens, parents, depths, keys, slots, n, draft_probs=draft_probs, depth_bound=layers)
