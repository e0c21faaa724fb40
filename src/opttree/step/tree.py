"""The draft tree as flat tensors, and pure functions that derive masks, positions and paths.

Nodes are stored parents-before-children (sorted by depth). The root (the last committed token,
not yet in the target's cache) is implicit: it is not one of the N nodes, and `parents == -1` means
"child of the root". Everything the verifier needs is derived from `parents` and `depths`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
import torch

from ..device import constant, host_array


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # (N,) long: drafted token ids
    parents: torch.Tensor  # (N,) long: index of the parent node, -1 for children of the root
    depths: torch.Tensor  # (N,) long: 1 for children of the root
    scores: torch.Tensor  # (N,) float: log p-hat, the estimated probability that the node is accepted
    draft_slots: torch.Tensor  # (N,) long: the drafter's KV slot of the node this step, -1 if never run
    # Draft distributions the candidates were *sampled* from, for recursive rejection sampling:
    # (N + 1, V), row 0 = root, row i + 1 = node i. None for deterministic (top-k) candidate sets.
    draft_probs: torch.Tensor | None = None
    # With draft_probs: (N,) the p-hat that ranked the sampled nodes (`ChildPicker.ranked`; -inf for a node that is
    # not a draw of its parent's distribution), and (N,) bool, the deterministic candidates among the nodes
    # (a node may be both). None: every node is a draw (keys not kept) / none is deterministic.
    keys: torch.Tensor | None = None
    proposed: torch.Tensor | None = None
    # Known on the host: the nodes are one chain of draws, node i + 1 a child of node i, each drawn from its parent's
    # draft distribution (draft_probs), none deterministic; verified then by block verification (`verify.accept_block`).
    chain: bool = False
    # Known on the host: the parents (as `parents`), where the policy chose the tree there; the verify mask is then
    # made on the host (`block_on_host`), in one copy.
    host_parents: tuple[int, ...] | None = None
    # Known on the host: each node's (token, parent, depth, score as its float32 value, drafter slot), where the tree
    # was made there; `merge_best` on the host reads these instead of the tensors.
    host_nodes: tuple[tuple[int, int, int, float, int], ...] | None = None
    # Known on the host: no node is deeper than this (0: not known), which bounds the rounds of `tree_block`.
    depth_bound: int = 0

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @cached_property
    def block(self) -> torch.Tensor:
        """(N + 1, N + 1) bool `tree_block` of this tree, computed once (the verify mask and acceptance share it)."""
        if self.host_parents is not None:
            return host_array(block_on_host(self.host_parents), self.parents.device)
        return tree_block(self.parents, self.depth_bound)

    @property
    def ancestors(self) -> torch.Tensor:
        """(N, N) bool `ancestor_mask` of this tree (a view of `block`)."""
        return self.block[1:, 1:]

    @property
    def drawn(self) -> torch.Tensor:
        """(N,) bool: the nodes drawn from their parent's draft distribution (all, for a tree without keys)."""
        return torch.isfinite(self.keys) if self.keys is not None else torch.ones_like(self.tokens, dtype=torch.bool)

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if len(self) else 0

    def to(self, device: torch.device) -> "DraftTree":
        """The same tree on `device` (a no-op when it is there already)."""
        if self.tokens.device == device:
            return self
        move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return DraftTree(*(move(getattr(self, f.name)) for f in dataclasses.fields(self)))

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> "DraftTree":
        long = torch.empty(0, dtype=torch.long, device=device)
        return DraftTree(long, long, long, torch.empty(0, device=device), long)


SQUARING_MAX_NODES = 128  # measured on a CPU: squaring is 3x faster at 16-64 nodes, 2x slower at 256


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """(N,) parents -> (N, N) bool, [i, j] True iff node j is node i or one of its ancestors.

    After round k every row holds the ancestors within 2^k levels, so ceil(log2 N) rounds suffice for
    any tree: a fixed number of rounds, known from the shape, so nothing is read back. Up to
    SQUARING_MAX_NODES nodes, by squaring the reach matrix M = I + A (A[i, j] = 1 iff j is i's parent):
    two ops a round, a matmul and a clamp that keeps M 0/1 (exact in any float format: a positive sum of
    0/1 products stays positive). Past that the N^3 matmuls cost more than pointer jumping's ~13 ops of
    N^2 a round.
    """
    n = parents.shape[0]
    if n <= SQUARING_MAX_NODES:
        return tree_block(parents)[1:, 1:]
    rounds = max(n - 1, 1).bit_length()
    cols = torch.arange(n, device=parents.device)
    mask = torch.zeros(n, n + 1, dtype=torch.bool, device=parents.device)  # (N, N+1), column N = "past the root"
    mask[cols, cols] = True
    jump = torch.where(parents >= 0, parents, n)  # (N,) the ancestor 2^k levels up, n once past the root
    mask[cols, jump] = True
    for _ in range(rounds):
        mask[:, :n] |= mask[jump.clamp(max=n - 1), :n] & (jump < n)[:, None]  # add the ancestors of the one 2^k up
        jump = torch.where(jump < n, torch.cat([jump, jump.new_full((1,), n)])[jump], n)
    return mask[:, :n]


def tree_block(parents: torch.Tensor, depth_bound: int = 0) -> torch.Tensor:
    """(N,) parents -> (N + 1, N + 1) bool over [root] + nodes, [i, j] True iff j is i or one of its ancestors (the
    root is every node's): the tree's part of the verify mask, and `ancestor_mask` without its first row and column.
    Up to SQUARING_MAX_NODES nodes by squaring the reach matrix of [root] + nodes, the root its own parent
    (`ancestor_mask` describes the method): 10 ops and two a round, ceil(log2 D) rounds for a tree known to be at
    most D deep (`depth_bound`; 0: N)."""
    n = parents.shape[0]
    if n > SQUARING_MAX_NODES:
        block = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=parents.device)
        block[:, 0] = True
        block[1:, 1:] = ancestor_mask(parents)
        return block
    up = torch.cat([constant((0,), parents.device), parents + 1])  # (N+1,) each row's parent row, the root's itself
    reach = (up[:, None] == torch.arange(n + 1, device=parents.device)).float() + _eye(n + 1, parents.device)
    deepest = min(depth_bound or n, n)  # hops from the deepest node to the root
    for _ in range(max(deepest - 1, 1).bit_length() if n else 0):
        reach = (reach @ reach).clamp_(max=1)
    return reach > 0


def block_on_host(parents: tuple[int, ...]) -> np.ndarray:
    """`tree_block` of parents the host holds (parents before children): (N + 1, N + 1) bool, a row a node."""
    n = len(parents)
    block = np.zeros((n + 1, n + 1), dtype=bool)
    block[:, 0] = True
    for i, parent in enumerate(parents):
        block[i + 1] = block[parent + 1]
        block[i + 1, i + 1] = True
    return block


@lru_cache(maxsize=16)
def _eye(size: int, device: torch.device) -> torch.Tensor:
    """(size, size) float identity, made once (read only)."""
    return torch.eye(size, device=device)


def tree_attention_mask(parents: torch.Tensor, prefix_len: int, block: torch.Tensor | None = None) -> torch.Tensor:
    """Mask for one forward over [root] + nodes: (N + 1, prefix_len + N + 1) bool, True = attend.

    Every query sees the committed prefix (already cached) and the root; a node also sees its
    ancestors and itself. Row 0 is the root. `block`: `tree_block(parents)` if already known.
    """
    block = tree_block(parents) if block is None else block  # (N+1, N+1) over [root] + nodes
    if prefix_len == 0:
        return block
    prefix = torch.ones(block.shape[0], prefix_len, dtype=torch.bool, device=block.device)  # (N+1, P)
    return torch.cat([prefix, block], dim=1)  # (N+1, P+N+1)


def padded_tree_mask(parents: torch.Tensor, prefix_len: int, width: int, capacity: int,
                     block: torch.Tensor | None = None, start: int | None = None) -> torch.Tensor:
    """The fixed-shape version of `tree_attention_mask`: [root] + N nodes padded to `width` nodes, over
    `capacity` keys where the W + 1 rows land at `start` (default prefix_len). (W + 1, capacity) bool:
    the real rows see the prefix [0, prefix_len) and their tree, nothing else (keys in [prefix_len,
    start) are another sequence's longer prefix in a batch, keys past the tree a preallocated cache's
    unused rows); a padding row attends to itself only (its output is never read, and no row is all-masked)."""
    n = parents.shape[0]
    start = prefix_len if start is None else start
    assert n <= width and prefix_len <= start and start + width + 1 <= capacity, (n, width, prefix_len, start, capacity)
    block = tree_block(parents) if block is None else block  # (N+1, N+1) over [root] + nodes
    if n == width and start == prefix_len and capacity == start + n + 1:  # nothing to pad
        return tree_attention_mask(parents, prefix_len, block)
    allowed = torch.zeros(width + 1, capacity, dtype=torch.bool, device=parents.device)  # (W+1, C)
    allowed[: n + 1, :prefix_len] = True
    allowed[: n + 1, start : start + n + 1] = block
    pad = torch.arange(n + 1, width + 1, device=parents.device)  # (W-N,)
    allowed[pad, start + pad] = True
    return allowed


def pad_nodes(values: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """(N + 1,) values at [root] + nodes -> (W + 1,), padded with `fill`."""
    if values.shape[0] == width + 1:
        return values
    return torch.cat([values, values.new_full((width + 1 - values.shape[0],), fill)])


def position_ids(depths: torch.Tensor, root_position: int) -> torch.Tensor:
    """(N,) depths -> (N + 1,) positions of [root] + nodes: the root sits at `root_position`."""
    return root_position + torch.cat([constant((0,), depths.device), depths])


def leaf_paths(parents: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """Root-to-leaf paths: (leaves, max_depth) node indices ordered by depth, padded with -1."""
    n = parents.shape[0]
    if n == 0:
        return torch.empty(0, 0, dtype=torch.long, device=parents.device)
    has_child = torch.zeros(n, dtype=torch.bool, device=parents.device)
    has_child[parents[parents >= 0]] = True
    leaves = (~has_child).nonzero().squeeze(1)  # (L,)
    on_path = ancestor_mask(parents)[leaves]  # (L, N): node j lies on the path to leaf l
    leaf_idx, node_idx = on_path.nonzero(as_tuple=True)
    paths = torch.full((leaves.shape[0], int(depths.max())), -1, dtype=torch.long, device=parents.device)
    paths[leaf_idx, depths[node_idx] - 1] = node_idx
    return paths  # (L, D)


# --- tries: trees from several sources (opttree.step.drafters.sources) ---

def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """The token path from the root to each node (the node's own token last), in node order."""
    tokens, parents = torch.stack([tree.tokens, tree.parents]).tolist()  # one read
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return paths


def merge(base: DraftTree, extra: DraftTree) -> DraftTree:
    """The union of two tries: a node of `extra` whose token path `base` already has becomes that node
    (its score the larger of the two, its drafter slot base's); the others hang under their path's
    deepest node, with slot -1. No node gets two children with one token. Sorted by depth again. The
    duplicates are dropped by value (a shape sync; `merge_best` takes the best nodes of a union without one)."""
    _no_draws([base, extra])
    device = base.tokens.device
    union, dead, _ = _union_on_device(base, torch.zeros(len(base), dtype=torch.bool, device=device), extra.to(device))
    return _live_by_depth(union, dead)


def merge_best(tries: list[DraftTree], n: int, floor: float = float("-inf")) -> DraftTree:
    """`top_nodes` of the tries' `merge`, on their device: the best tree of at most n nodes by score (ties to
    the shallower, then the earlier node of the union, whose nodes are the first trie's, then each other's new
    paths), nodes scored below `floor` dropped. Scores must not rise along a path (log p-hat, log hit rates:
    a node's score is then its path's lowest, and its parent is chosen before it). Nothing is read back when
    the first trie alone has n nodes and no floor applies: then the n best are never a duplicate path, and
    nodes scored -inf (a policy's candidates past its stop, kept to fill a fixed size) come after every finite
    one. Otherwise the nodes scored -inf are dropped (a shape sync). On a CPU the same is computed on the host
    (`merge_on_host`)."""
    _no_draws(tries)
    if merge_on_host(tries[0].tokens.device) and any(len(trie) for trie in tries):
        return _merge_best_on_host(tries, n, floor)
    union, dead = tries[0], torch.zeros(len(tries[0]), dtype=torch.bool, device=tries[0].tokens.device)
    for extra in tries[1:]:
        union, dead, _ = _union_on_device(union, dead, extra.to(union.tokens.device))
    if len(union) == 0:
        return union
    scores = union.scores.masked_fill(union.scores < floor, float("-inf"))  # (U,)
    rank = torch.where(dead, float("-inf"), scores.clamp(min=torch.finfo(scores.dtype).min))  # duplicates last
    order = torch.sort(union.depths, stable=True).indices  # ties to the shallower, then the earlier
    order = order[torch.sort(rank[order], descending=True, stable=True).indices][:n]  # (min(n, U),)
    if len(tries[0]) < n or floor > float("-inf"):
        order = order[(scores[order] > float("-inf")) & ~dead[order]]  # a shape sync
    kept = order.sort().values
    return subtree(union, kept[torch.sort(union.depths[kept], stable=True).indices])


def merge_on_host(device: torch.device) -> bool:
    """Where `merge_best` unites its tries: on the device (fixed shapes, nothing read back) everywhere but on a CPU,
    where the tries' few dozen nodes are read once and united by token path in Python: 39 against 119 us for tries of
    16 and 12 nodes, and a batch of 8 `recycling+lookup` rows 1.06-1.09x faster on a 2-core AMD EPYC
    (docs/BENCHMARKS.md, "Tries merged on the host on a CPU"). `OPTTREE_MERGE=device` or `=host` forces one (tests run both)."""
    forced = os.environ.get("OPTTREE_MERGE", "auto")
    return forced == "host" or (forced != "device" and device.type == "cpu")


_NUMPY_FLOATS = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def _merge_best_on_host(tries: list[DraftTree], n: int, floor: float) -> DraftTree:
    """`merge_best` computed in Python from one read of each trie: the same union (the first trie's nodes, then each
    other trie's new paths in its order; a path found again gives its score to the node that has it, the larger
    stays, and counts as a duplicate), the same order (by score, duplicates last, ties to the shallower, then the
    earlier node) and the same cut; returned on the first trie's device."""
    first = tries[0]
    rounded = _NUMPY_FLOATS.get(first.scores.dtype)
    floor = float(rounded(floor)) if rounded is not None else floor  # rounded as a tensor of scores compares with it
    tokens, parents, depths, scores, slots = [], [], [], [], []
    dead: list[bool] = []
    node_of: dict[tuple[int, ...], int] = {}  # token path -> its node in the union
    for which, trie in enumerate(tries):
        paths: list[tuple[int, ...]] = []
        for token, parent, depth, score, slot in _read(trie):
            path = (paths[parent] if parent >= 0 else ()) + (token,)
            paths.append(path)
            found = node_of.get(path)
            if found is not None and which:  # a duplicate: its score goes to the node with its path
                scores[found] = max(scores[found], score)
            else:
                node_of.setdefault(path, len(tokens))
            tokens.append(token)
            parents.append(node_of[path[:-1]] if len(path) > 1 else -1)
            depths.append(depth)
            scores.append(float("-inf") if found is not None and which else score)
            slots.append(slot if not which else -1)
            dead.append(found is not None and which > 0)
    cut = [s if s >= floor else float("-inf") for s in scores]
    lowest = float(torch.finfo(first.scores.dtype).min)
    rank = [float("-inf") if gone else max(s, lowest) for s, gone in zip(cut, dead)]  # duplicates last
    order = sorted(range(len(tokens)), key=lambda i: (-rank[i], depths[i], i))[:n]
    if len(first) < n or floor > float("-inf"):
        order = [i for i in order if cut[i] > float("-inf") and not dead[i]]
    kept = sorted(sorted(order), key=lambda i: depths[i])  # by depth, then union order
    new_index = {old: new for new, old in enumerate(kept)}
    new_parents = [new_index.get(parent, -1) for parent in parents]
    columns = torch.tensor([[values[i] for i in kept] for values in (tokens, new_parents, depths, slots)],
                           dtype=torch.long, device=first.tokens.device)  # (4, K) the kept nodes' values
    kept_tokens, kept_parents, kept_depths, kept_slots = columns.unbind(0)
    return DraftTree(kept_tokens, kept_parents, kept_depths,
                     torch.tensor([scores[i] for i in kept], dtype=first.scores.dtype, device=first.tokens.device),
                     kept_slots, host_parents=tuple(new_parents[i] for i in kept))  # its verify mask made on the host


def _read(trie: DraftTree) -> list[tuple[int, int, int, float, int]]:
    """(token, parent, depth, score, drafter slot) of each node, in one read (float64 holds the ids and the float32
    scores exactly); none where the host made the tree (`host_nodes`)."""
    if trie.host_nodes is not None:
        return list(trie.host_nodes)
    n = len(trie)
    columns = torch.cat([torch.cat([trie.tokens, trie.parents, trie.depths, trie.draft_slots]).double(),
                         trie.scores.double()]).tolist()  # (5N,): four long columns, then the scores
    return [(int(t), int(p), int(d), s, int(slot)) for t, p, d, slot, s in
            zip(*(columns[i * n:(i + 1) * n] for i in range(5)))]


def _union_on_device(base: DraftTree, dead: torch.Tensor, extra: DraftTree
                     ) -> tuple[DraftTree, torch.Tensor, torch.Tensor]:
    """`merge`'s union of `base` (its duplicate nodes flagged in `dead` (N,)) and `extra` (M nodes, parents
    first), with fixed shapes: (the N + M nodes, not sorted by depth, (N + M,) bool dead, (M,) the base node
    each extra node's path is, -1 for none). A node of `extra`
    whose path `base` has gives its score to that node (the larger stays) and is flagged dead; the others
    hang under their parent's node in the union."""
    n, m = len(base), len(extra)
    if m == 0 or n == 0:  # nothing to match: the union is the other trie, with slots -1
        union = base if m == 0 else DraftTree(extra.tokens, extra.parents, extra.depths, extra.scores,
                                              torch.full_like(extra.tokens, -1))
        return union, torch.zeros(len(union), dtype=torch.bool, device=dead.device), torch.full_like(extra.tokens, -1)
    # Two nodes share a path when they sit at one depth and no depth holds two different tokens on their paths:
    # each path has one node a depth, so the ancestor masks count those depths in two products (exact in float32)
    same_depth = extra.depths[:, None] == base.depths[None, :]  # (M, N)
    differ = (same_depth & (extra.tokens[:, None] != base.tokens[None, :])).float()  # (M, N)
    mismatches = extra.ancestors.float() @ differ @ base.ancestors.float().T  # (M, N) depths whose tokens differ
    same = same_depth & (mismatches == 0) & ~dead[None, :]
    found = torch.where(same.any(dim=1), same.byte().argmax(dim=1), -1)  # (M,) base node with the path, or -1
    union_index = torch.where(found >= 0, found, n + torch.arange(m, device=found.device))  # (M,)
    parents = torch.where(extra.parents >= 0, union_index[extra.parents.clamp(min=0)], -1)
    best = base.scores.scatter_reduce(0, found.clamp(min=0), extra.scores.masked_fill(found < 0, float("-inf")),
                                      reduce="amax")  # (N,)
    union = DraftTree(torch.cat([base.tokens, extra.tokens]), torch.cat([base.parents, parents]),
                      torch.cat([base.depths, extra.depths]),
                      torch.cat([best, extra.scores.masked_fill(found >= 0, float("-inf"))]),
                      torch.cat([base.draft_slots, torch.full_like(extra.tokens, -1)]))
    return union, torch.cat([dead, found >= 0]), found


def _no_draws(tries: list[DraftTree]) -> None:
    if any(trie.draft_probs is not None for trie in tries):
        raise ValueError("sampled candidates (with draft_probs) cannot be merged with another source's: their "
                         "verification needs exactly the distribution they were drawn from (`merge_sampled`)")


def _live_by_depth(union: DraftTree, dead: torch.Tensor) -> DraftTree:
    """A union's nodes but its duplicates, sorted by depth again (stably: the first trie's first). A shape sync."""
    kept = (~dead).nonzero().squeeze(1)
    return subtree(union, kept[torch.sort(union.depths[kept], stable=True).indices])


def merge_sampled(sampled: DraftTree, proposed: DraftTree) -> DraftTree:
    """The union of a tree of sampled children (with draft_probs) and a trie of deterministic candidates
    (`merge`'s union by token path, made on the device). A node on both keeps the sampled node's slot, key and
    score and is marked proposed too; a proposed-only node gets key -inf (it is no draw) and no draft
    distribution (no sampled child hangs under it). Sorted by depth again, siblings' draw order kept. The
    duplicates are dropped by value (a shape sync)."""
    assert sampled.draft_probs is not None and proposed.draft_probs is None
    device, n = sampled.tokens.device, len(sampled)
    union, dead, found = _union_on_device(sampled, torch.zeros(n, dtype=torch.bool, device=device), proposed.to(device))
    added = len(union) - n
    on_both = torch.zeros(n + 1, dtype=torch.bool, device=device).index_fill_(0, found + 1, True)[1:]  # (N,)
    keys = sampled.keys if sampled.keys is not None else torch.zeros(n, device=device)
    merged = DraftTree(union.tokens, union.parents, union.depths, torch.cat([sampled.scores, union.scores[n:]]),
                       union.draft_slots,
                       torch.cat([sampled.draft_probs, sampled.draft_probs.new_zeros(added, sampled.draft_probs.shape[1])]),
                       torch.cat([keys, keys.new_full((added,), float("-inf"))]),
                       torch.cat([on_both, torch.ones(added, dtype=torch.bool, device=device)]))
    return _live_by_depth(merged, dead)


def subtree(tree: DraftTree, keep: torch.Tensor) -> DraftTree:
    """The nodes `keep` (K,) (in this order, parents before children, every kept node's parent kept),
    re-indexed. Draft distributions are kept for the root and the kept nodes; a chain of draws stays one (the kept
    nodes of a chain are a prefix of it)."""
    n = len(tree)
    new_index = torch.full((n + 1,), -1, dtype=torch.long, device=tree.tokens.device)  # [i + 1] = new index of i
    new_index[keep + 1] = torch.arange(keep.shape[0], device=keep.device)
    parents = new_index[tree.parents[keep] + 1]
    torch._assert_async((parents >= 0).eq(tree.parents[keep] >= 0).all(), "the kept nodes are not a tree")  # no sync
    probs = None
    if tree.draft_probs is not None:
        probs = tree.draft_probs[torch.cat([torch.zeros(1, dtype=torch.long, device=keep.device), keep + 1])]
    pick = lambda t: None if t is None else t[keep]  # noqa: E731
    return DraftTree(tree.tokens[keep], parents, tree.depths[keep], tree.scores[keep], tree.draft_slots[keep], probs,
                     pick(tree.keys), pick(tree.proposed), chain=tree.chain and keep.shape[0] > 0)


def top_nodes(tree: DraftTree, n: int, by: torch.Tensor | None = None) -> DraftTree:
    """The best tree of at most n nodes by score (or by `by` (N,)), where a node counts at the lowest score
    on its path (so a kept node's parent is kept; ties go to the earlier node). Nodes scored -inf are dropped."""
    if len(tree) == 0:
        return tree
    path_min = path_min_scores(tree, by)  # (N,)
    order = torch.sort(path_min, descending=True, stable=True).indices
    order = order[path_min[order] > float("-inf")][:n]
    return subtree(tree, order.sort().values)


def path_min_scores(tree: DraftTree, by: torch.Tensor | None = None) -> torch.Tensor:
    """(N,) each node's lowest score (or `by` (N,)) on its path from the root: a node never outranks its parent."""
    scores = tree.scores if by is None else by
    return torch.where(tree.ancestors, scores[None, :], float("inf")).amin(dim=1)


def allocate(trees: list[DraftTree], n: int, scores: torch.Tensor | None = None) -> list[DraftTree]:
    """Batch-level OPT-Tree: one budget of n nodes for several rows' candidate trees, given to the n nodes
    with the largest path score across all of them (a node counts at the lowest score on its path, ties
    go to the earlier row, then the earlier node). With scores that fall along a path (log p-hat: path
    probabilities), this maximises the sum of the rows' expected accepted lengths over every way of
    splitting n nodes among them, and each row keeps a tree (a kept node's parent is kept). Trees with
    sampled nodes (draft_probs) are not split: their nodes were drawn for their own budget.
    `scores`: `candidate_scores(trees)`, when the caller has it already."""
    split = splittable(trees)
    if not split:
        return trees
    scores = candidate_scores(trees) if scores is None else scores  # (M,)
    order = torch.sort(scores, descending=True, stable=True).indices
    kept = torch.zeros_like(scores, dtype=torch.bool)
    kept[order[: max(n, 0)]] = True
    kept &= scores > float("-inf")
    out, start = list(trees), 0
    for i in split:
        size = len(trees[i])
        out[i] = subtree(trees[i], kept[start : start + size].nonzero().flatten())
        start += size
    return out


def splittable(trees: list[DraftTree]) -> list[int]:
    """The trees a batch budget may cut: non-empty, of deterministic candidates."""
    return [i for i, tree in enumerate(trees) if tree.draft_probs is None and len(tree)]


def candidate_scores(trees: list[DraftTree]) -> torch.Tensor:
    """(M,) the path scores of every node of the `splittable` trees, in order."""
    split = splittable(trees)
    if not split:
        return torch.empty(0)
    return torch.cat([path_min_scores(trees[i]) for i in split])
