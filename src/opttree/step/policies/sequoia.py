"""Sequoia: the optimal static tree for a budget and depth, from a positional acceptance vector.

Positional acceptance (Sequoia, Chen et al. 2024): `acc[k]` is the probability that the (k+1)-th
child of an accepted node is the one the verifier accepts (so sum(acc) <= 1). A node reached by
ranks r1, r2, ..., rd is then accepted with probability acc[r1] * ... * acc[rd], and the tree of
`budget` nodes and depth <= max_depth maximising the sum of those products is found by dynamic
programming (`optimal_tree`). Children of a node use ranks 0, 1, ..., c - 1.

At temperature 0 a node's children are the draft's top-ranked tokens (acc[k] = how often the
target's argmax is the draft's (k+1)-th choice), verified by token matching. At temperature > 0
they are drawn without replacement from the draft's distribution (warped like the target's) and
verified by recursive rejection sampling (acc[k] = how often the k-th draw is accepted).

The vector is measured on calibration prompts (`acceptance_vector`; `opttree calibrate`
saves the greedy one and the sampled one, at temperature 1, under PROFILE_FIELD of the profile)
and reaches the policy as `SpecConfig.acceptance` (the CLI and `opttree bench` pass the calibrated
one for the pair when a profile exists). Without one, `DEFAULT_ACCEPTANCE` is used: a first-choice
agreement of 0.7 (the shipped draft's measured greedy vector starts at 0.71: docs/BENCHMARKS.md, "Tree
policies at equal budgets") and a tail falling by about half per rank.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Sequence

import numpy as np
import torch

from ...settings.config import SpecConfig, check_acceptance
from ..drafters import Drafter
from ..sampling import Warp, sample_without_replacement, target_probs
from ..tree import DraftTree
from .registry import register_policy
from .shapes import DEFAULT_ACCEPTANCE, ChildPicker, Path, TreePlans, check_paths, valued_paths

PROFILE_FIELD = "sequoia_acceptance"  # in a calibration profile: {"greedy": [...], "sampled": [...]}


def profile_vector(profile: dict, greedy: bool) -> tuple[float, ...] | None:
    """The vector a calibration profile holds for greedy decoding or for sampling, if any."""
    vector = (profile.get(PROFILE_FIELD) or {}).get("greedy" if greedy else "sampled")
    return tuple(vector) if vector else None


def optimal_tree(acc: Sequence[float], budget: int, max_depth: int) -> list[Path]:
    """The rank paths of the tree of at most `budget` nodes and depth <= max_depth that maximises
    the sum over its nodes of the product of acc[rank] along the node's path. Sorted by depth."""
    _, paths = _solve(check_acceptance(acc), budget, max_depth)
    return sorted(paths, key=lambda p: (len(p), p))


def tree_value(acc: Sequence[float], paths: Sequence[Sequence[int]]) -> float:
    """Expected accepted tokens of a tree under the positional model: sum over nodes of prod acc[rank]."""
    return float(sum(np.prod([acc[r] for r in p]) for p in paths))


@lru_cache(maxsize=64)
def _solve(acc: tuple[float, ...], n: int, depth: int) -> tuple[float, list[Path]]:
    """Tree knapsack over ranks. best[d, m] = the largest value of the nodes below a node, using
    at most m of them within d levels; children take ranks 0, 1, ... with subtrees of s_i nodes:
    g_i(m) = max(0, max_{1 <= s <= m} acc[i] * (1 + best[d-1, s-1]) + g_{i+1}(m - s))."""
    width = min(len(acc), n)
    best = np.zeros((depth + 1, n + 1))  # (D+1, n+1)
    split = np.zeros((depth + 1, width, n + 1), dtype=np.int64)  # nodes given to child i's subtree, 0 = none
    m = np.arange(n + 1)
    s = np.arange(1, n + 1)
    fits = s[None, :] <= m[:, None]  # (n+1, n): child subtree of s nodes fits in m
    rest = np.where(fits, m[:, None] - s[None, :], 0)  # (n+1, n): nodes left for the later siblings
    for d in range(1, depth + 1):
        g = np.zeros(n + 1)  # g_{width}: no more children
        for i in reversed(range(width)):
            child = acc[i] * (1 + best[d - 1, s - 1])  # (n,): value of child i with a subtree of s nodes
            value = np.where(fits, child[None, :] + g[rest], -np.inf)  # (n+1, n)
            pick = value.argmax(axis=1)  # (n+1,) first best: the smallest subtree on ties
            take = value[m, pick] > 0  # better than ending the children here
            split[d, i] = np.where(take, pick + 1, 0)
            g = np.where(take, value[m, pick], 0.0)
        best[d] = g

    def subtree(d: int, budget: int, prefix: Path) -> list[Path]:
        paths: list[Path] = []
        for i in range(width):
            size = int(split[d, i, budget]) if d else 0
            if size == 0:
                break
            paths.append(prefix + (i,))
            paths += subtree(d - 1, size - 1, prefix + (i,))
            budget -= size
        return paths

    return float(best[depth, n]), subtree(depth, n, ())


def acceptance_vector(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], width: int = 8, temperature: float = 0.0,
                      top_k: int = 0, top_p: float = 1.0, seed: int = 0, draft_temperature: float = 1.0) -> list[float]:
    """acc[k] = P(the (k+1)-th child is the accepted one), averaged over every position of (target
    logits (P, V), draft logits (P, V)) pairs: `opttree.alignment.paired_logits` on calibration
    prompts, generated at the same temperature.

    Temperature 0: the rank of the target's argmax in the draft's order. Otherwise: `width` draws
    without replacement from q (the draft's logits / draft_temperature, warped like p), and the exact
    probability, given the draws, that recursive rejection sampling accepts each one.
    """
    generator = torch.Generator().manual_seed(seed)
    total = torch.zeros(width, dtype=torch.float64)
    positions = 0
    for target_logits, draft_logits in pairs:
        total += _accepted_by_rank(target_logits, draft_logits / draft_temperature, width, temperature, top_k, top_p,
                                   generator)
        positions += target_logits.shape[0]
    return (total / max(positions, 1)).tolist()


def _accepted_by_rank(target_logits, draft_logits, width, temperature, top_k, top_p, generator) -> torch.Tensor:
    """(P, V) logits of both models -> (width,) summed probability that child k is the accepted one."""
    if temperature == 0:
        choice = target_logits.argmax(dim=-1, keepdim=True)  # (P, 1)
        rank = (draft_logits > draft_logits.gather(1, choice)).sum(dim=1)  # (P,) draft rank of the target's token
        return torch.bincount(rank[rank < width], minlength=width)[:width].double()
    warp = Warp(temperature, top_k, top_p)
    p = target_probs(target_logits, warp).double()  # (P, V)
    q = target_probs(draft_logits, warp).double()  # (P, V)
    draws, valid = sample_without_replacement(q.log().float(), width, generator)  # (P, w)
    rows = torch.arange(p.shape[0])
    reach = torch.ones(p.shape[0], dtype=torch.float64)  # P(every earlier child rejected)
    out = torch.zeros(width, dtype=torch.float64)
    for k in range(draws.shape[1]):
        x = draws[:, k]
        accept = torch.where(valid[:, k], (p[rows, x] / q[rows, x].clamp(min=1e-300)).clamp(max=1.0), 0.0)  # (P,)
        out[k] = (reach * accept).sum()
        reach = reach * (1 - accept)
        p = (p - q).clamp(min=0)
        p = p / p.sum(dim=1, keepdim=True).clamp(min=1e-300)
        q[rows, x] = 0
        q = q / q.sum(dim=1, keepdim=True).clamp(min=1e-300)
    return out


@register_policy("sequoia")
class Sequoia:
    needs_drafter = True
    sampled_keys = False

    def __init__(self, config: SpecConfig):
        acc = config.acceptance or DEFAULT_ACCEPTANCE
        self.paths = check_paths(optimal_tree(acc, config.budget, config.max_depth))
        self.picker = ChildPicker(config, sampled=True)  # top-ranked children at temperature 0
        self.plans = TreePlans(lambda max_depth, vocab: valued_paths(self.paths, acc, max_depth, vocab))

    def build(self, drafter: Drafter, committed: torch.Tensor, depth_limit: int) -> DraftTree:
        return self.plans.grow(drafter, committed, depth_limit, self.picker)
