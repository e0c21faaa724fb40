"""Verification: one target forward over [root] + tree, and acceptance as pure functions."""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import Cache, PreTrainedModel

from ..device import static_step
from ..settings.config import SpecConfig
from .attention import key_positions, layer_masks, mask_layout
from .cache import cache_argument, capacity, compact_rows, is_static
from .lean import LeanForward, Rider, lean_forward
from .sampling import PositionNoise, Warp, as_float32, inverse_cdf, race, target_probs, warp_logits
from .tree import DraftTree, pad_nodes, padded_tree_mask, position_ids, tree_attention_mask


@dataclass(frozen=True)
class HostMatch:
    """A step's acceptance by matching left to the host (`match_on_host`): the step's one read takes the tree with the
    target's choices, which costs a handful of ops against some thirty for matching on the device (`matching_path`)
    and reading its path."""

    choice: torch.Tensor  # (N + 1,) the target's token at [root] + nodes (`target_choice`)


@dataclass(frozen=True)
class StepReadout:
    """What the host learns of a step, in the step's one read from the device (`read`)."""

    accepted: int  # draft nodes accepted
    emitted: list[int]  # the accepted tokens and the bonus
    slots: list[int]  # the drafter's slots of the accepted nodes (-1 = never run by the drafter)
    depth: int  # the tree's depth (0 for an empty tree)
    siblings: int = 0  # the most sampled children of one node (0: none sampled): rejection sampling's next bound
    path: list[int] | None = None  # the accepted nodes, root to leaf, where the host matched them (`HostMatch`)

    @staticmethod
    def read(tree: DraftTree, path: torch.Tensor, length: torch.Tensor, bonus: torch.Tensor) -> "StepReadout":
        """One `.tolist()` of (length, depth, bonus, most sampled siblings, tokens and slots along the path).
        path: (N,) from `accept_path`, its first `length` entries the accepted nodes."""
        return StepReadout.read_rows([(tree, (path, length, bonus))])[0]

    @staticmethod
    def read_rows(rows: list[tuple[DraftTree, tuple | HostMatch]]) -> list["StepReadout"]:
        """`read` for every row of a batch, in one `.tolist()`: per row its tree and its acceptance, a path on the
        device (path, length, bonus) or a `HostMatch` (then the tree's tokens, parents and slots are read with the
        target's choices, and matched here)."""
        parts = []
        for tree, outcome in rows:
            if isinstance(outcome, HostMatch):
                parts += [outcome.choice, tree.tokens, tree.parents, tree.draft_slots]
                continue
            path, length, bonus = outcome
            depth = tree.depths.max().view(1) if len(tree) else tree.depths.new_zeros(1)
            parts += [length.view(1), depth, bonus.view(1), _most_siblings(tree), tree.tokens[path],
                      tree.draft_slots[path]]
        values, out, at = torch.cat(parts).tolist(), [], 0
        for tree, outcome in rows:
            n = len(tree)
            if isinstance(outcome, HostMatch):
                choice = values[at : at + n + 1]
                tokens, parents, slots = (values[at + n + 1 + i * n : at + n + 1 + (i + 1) * n] for i in range(3))
                path, bonus = match_on_host(tokens, parents, choice)
                out.append(StepReadout(len(path), [tokens[i] for i in path] + [bonus], [slots[i] for i in path],
                                       _host_depth(parents), path=path))
                at += 4 * n + 1
                continue
            a, depth, bonus, siblings = values[at : at + 4]
            row = values[at + 4 : at + 4 + 2 * n]
            out.append(StepReadout(a, row[:a] + [bonus], row[n : n + a], depth, siblings))
            at += 4 + 2 * n
        return out


def _host_depth(parents: list[int]) -> int:
    """The depth of a tree given by its parents (parents before children, -1 = the root): 0 for an empty tree."""
    depths: list[int] = []
    for parent in parents:
        depths.append(depths[parent] + 1 if parent >= 0 else 1)
    return max(depths, default=0)


def _most_siblings(tree: DraftTree) -> torch.Tensor:
    """(1,) long: the most sampled (drawn) children of one node of a tree with draft distributions, else 0 (and 0
    where rejection sampling walks the path on the host, which needs no bound)."""
    if tree.draft_probs is None or len(tree) == 0 or not rejection_on_device(tree.parents.device):
        return tree.parents.new_zeros(1)
    counts = torch.zeros(len(tree) + 1, dtype=torch.long, device=tree.parents.device)
    return counts.index_add_(0, tree.parents + 1, tree.drawn.long()).max().view(1)


@dataclass(frozen=True)
class Verification:
    """One step's verification, as the drafter sees it (`Drafter.observe`): what was verified, what the
    target computed there, and what it accepted. Handed over after both caches are compacted."""

    root: torch.Tensor  # () long: the last committed token before the step
    tree: DraftTree  # the N verified nodes (tokens, parents, depths, scores, draft slots)
    logits: torch.Tensor  # (N + 1, V) the target's logits at [root] + nodes
    accepted: torch.Tensor  # (A,) accepted node indices, root to leaf
    bonus: torch.Tensor  # () the target's token after the accepted path
    # The target's hidden states at [root] + nodes, one (N + 1, H) tensor per layer as transformers
    # numbers them (0 = the embeddings, -1 = the last layer's output), for a drafter or a depth control
    # that reads the target (`wants_hidden = True`; None otherwise).
    hidden_states: tuple[torch.Tensor, ...] | None = None
    readout: StepReadout | None = None  # the same, as the host read it (read here if not given)

    def __post_init__(self):
        if self.readout is None:
            path, length, bonus = _as_path(len(self.tree), self.accepted, self.bonus)
            object.__setattr__(self, "readout", StepReadout.read(self.tree, path, length, bonus))

    def accepted_hidden(self, layer: int = -1) -> torch.Tensor:
        """(A + 1, H) the target's hidden states of `layer` at the root and the accepted nodes: the
        features of the tokens this step committed (the bonus has none yet: the next verification
        computes it)."""
        assert self.hidden_states is not None, "nothing asked for hidden states (wants_hidden = True)"
        hidden = self.hidden_states[layer]
        rows = torch.cat([torch.zeros(1, dtype=torch.long, device=self.accepted.device), self.accepted + 1])
        return hidden[rows.to(hidden.device)]

    @property
    def tokens(self) -> torch.Tensor:
        """(N + 1,) the verified tokens: [root] + nodes."""
        return torch.cat([self.root.view(1), self.tree.tokens])

    @property
    def accepted_slots(self) -> torch.Tensor:
        """(A,) the drafter's slots of the accepted nodes (-1 = never run by the drafter)."""
        return self.tree.draft_slots[self.accepted]


def masked_forward(
    model: PreTrainedModel,
    cache: Cache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    allowed: torch.Tensor | None,
    hidden: bool = False,
    forward=None,
    keys: Callable[[], torch.Tensor] | None = None,
    riders: tuple[Rider, ...] = (),
):
    """Run `model` on new tokens with an explicit attention pattern, appending them to `cache`.

    input_ids: (Q,), positions: (Q,), allowed: (Q, K) bool, True = attend, K = cache_len + Q (or a
    static cache's capacity); None = causal (the model's own mask). `forward`: what runs the model
    (default: the model's own forward, or the same computation without transformers' wrapping where
    `lean.lean_forward` reproduces it). `keys`: returns the (K,) positions of the keys, for layers with a
    window (`opttree.step.attention`); default: the cache holds positions 0..K-Q-1 and the new rows follow.
    A batch: input_ids and positions (B, Q), allowed (B, Q, K), `keys` returns (B, K).
    `riders`: prompts prefilled in the same forward where the lean one runs it (`lean.Rider`), else in their own.
    Returns logits (Q, V); with `hidden`, (logits, every layer's hidden states ((Q, H), ...)); a batch
    keeps its batch axis: (B, Q, V), ((B, Q, H), ...).
    """
    batched = input_ids.dim() == 2
    ids, where = (input_ids, positions) if batched else (input_ids[None], positions[None])  # (B, Q)
    bias = None
    if allowed is not None and not batched:  # one sequence: (Q, K) -> (1, 1, Q, K)
        bias = attention_bias(model, allowed, positions, keys)
    elif allowed is not None:  # a batch: (B, Q, K), a mask a row
        count = allowed.shape[0]
        if keys is not None:
            every = functools.cache(keys)  # (B, K), built at most once, where a layer type has a window
            row_keys = [lambda b=b: every()[b] for b in range(count)]
        else:
            row_keys = [keys] * count
        bias = _stack([attention_bias(model, allowed[b], where[b], row_keys[b]) for b in range(count)])
    run = forward or lean_forward(model, bias) or model
    if riders and not isinstance(run, LeanForward):
        for rider in riders:
            rider.alone(model)
        riders = ()
    with masked_attention_kernels(ids.device):
        out = run(
            input_ids=ids,
            position_ids=where,
            attention_mask=bias,
            **{cache_argument(model): cache},
            use_cache=True,
            output_hidden_states=hidden,
            **({"riders": riders} if riders else {}),
        )
    if batched:
        return (out.logits, out.hidden_states) if hidden else out.logits  # (B, Q, V), ((B, Q, H),)
    return (out.logits[0], tuple(h[0] for h in out.hidden_states)) if hidden else out.logits[0]  # (Q, V), ((Q, H),)


def _stack(masks: list) -> torch.Tensor | dict[str, torch.Tensor]:
    """Per-row 4D masks (1, 1, Q, K) (or dicts of them, by layer type) -> one (B, 1, Q, K) (or a dict)."""
    if len(masks) == 1:
        return masks[0]
    if isinstance(masks[0], dict):
        return {kind: torch.cat([mask[kind] for mask in masks]) for kind in masks[0]}
    return torch.cat(masks)


def attention_bias(model, allowed: torch.Tensor, positions: torch.Tensor,
                   keys: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """(Q, K) bool, True = attend -> the 4D mask `model` takes, or one per layer type: each layer type's
    window applied on positions (`opttree.step.attention`; positions: (Q,) of the queries, `keys` as
    `masked_forward`'s); sdpa takes the bool mask as is, eager an additive float mask in the model's dtype."""
    queries = positions if positions.dim() == 1 else positions.reshape(-1)  # (Q,)

    def default_keys() -> torch.Tensor:
        return key_positions(allowed.shape[1] - queries.shape[0], queries, allowed.shape[1])

    masks = layer_masks(mask_layout(model.config.get_text_config()), allowed, queries, keys or default_keys)
    if isinstance(masks, dict):
        return {kind: _bias(model, mask) for kind, mask in masks.items()}
    return _bias(model, masks)


def _bias(model, allowed: torch.Tensor) -> torch.Tensor:
    mask = allowed.view(1, 1, *allowed.shape)  # (1, 1, Q, K)
    if model.config._attn_implementation == "eager":
        dtype = model.dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def masked_attention_kernels(device: torch.device):
    """sdpa backends for tree forwards. On CUDA, cuDNN's attention builds an execution plan for every
    new (query, key) shape, 1-60 ms of host time each, and a tree step's shapes are new almost every
    time (measured on an H100, torch 2.11: plain decoding 10 tokens/s with it, 110 without): leave it out."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def verify_tree(
    target: PreTrainedModel, cache: Cache, root: torch.Tensor, tree: DraftTree, prefix_len: int, hidden: bool = False,
    width: int = 0, compiled: bool = True,
):
    """One target forward over [root] + tree nodes. The cache holds `prefix_len` tokens before the
    call and `prefix_len + N + 1` after it (a static cache: `prefix_len + W + 1`, compaction drops the
    padding). Returns logits (N + 1, V): row 0 = root; with `hidden`, (logits, every layer's hidden
    states ((N + 1, H), ...)). One sequence of `verify_trees`."""
    return verify_trees(target, cache, [root], [tree], [prefix_len], hidden, width, compiled)[0]


def verify_trees(
    target: PreTrainedModel, cache: Cache, roots: list[torch.Tensor], trees: list[DraftTree], prefix_lens: list[int],
    hidden: bool = False, width: int = 0, compiled: bool = True, riders: tuple[Rider, ...] = (),
) -> list:
    """One target forward over a batch of [root] + tree, one row per sequence: row b's cache holds its
    `prefix_lens[b]` committed tokens (the cache itself is as long as the longest). Every tree is padded
    to the widest (padding rows attend to themselves only and are never read) and lands after the
    longest prefix; a row attends to its own prefix and its own tree's ancestors, nothing else, at
    positions prefix_len + depth. Returns per row the logits (N_b + 1, V), row 0 = root; with `hidden`,
    (logits, every layer's hidden states ((N_b + 1, H), ...)). `riders`: prompts prefilled in the same forward
    (`masked_forward`).

    Over a static cache (`opttree.step.cache.static_cache`, one sequence) the forward has one shape per
    `width`: the tree is padded to `width` nodes and the keys span the cache's whole capacity; it runs
    the model's compiled step if it has one (`static_step`) and `compiled`."""
    static, start = is_static(cache), max(prefix_lens)  # the step's rows land at the longest prefix
    assert not static or len(trees) == 1, "a static cache holds one sequence"
    sizes = [len(tree) for tree in trees]
    width = max(width, *sizes) if static else max(sizes)  # a tree past the static width gets a shape of its own
    keys = capacity(cache) if static else start + width + 1
    if not static and len(trees) == 1:  # one sequence: its own shapes, no batch axis to make and take apart
        return [_verify_one(target, cache, roots[0], trees[0], start, hidden, riders)]
    tokens = torch.stack([pad_nodes(torch.cat([root.view(1), tree.tokens]), width, 0)
                          for root, tree in zip(roots, trees)])  # (B, W+1)
    positions = torch.stack([pad_nodes(position_ids(tree.depths, p), width, p)
                             for tree, p in zip(trees, prefix_lens)])  # (B, W+1)
    if not static and width == 0 and all(p == start for p in prefix_lens):
        allowed = None  # the roots alone, one token after each cache: the model's own causal mask
    else:
        allowed = torch.stack([padded_tree_mask(tree.parents, p, width, keys, tree.block, start)
                               for tree, p in zip(trees, prefix_lens)])  # (B, W+1, K)
    forward = static_step(target) if static and compiled and cache.is_initialized else None  # a first forward allocates
    out = masked_forward(target, cache, tokens, positions, allowed, hidden, forward,
                         keys=lambda: torch.stack([key_positions(start, row, keys) for row in positions]),
                         riders=riders)
    logits, states = out if hidden else (out, None)  # (B, W+1, V), ((B, W+1, H),)
    if not hidden:
        return [logits[b, : n + 1] for b, n in enumerate(sizes)]
    return [(logits[b, : n + 1], tuple(h[b, : n + 1] for h in states)) for b, n in enumerate(sizes)]


def _verify_one(target: PreTrainedModel, cache: Cache, root: torch.Tensor, tree: DraftTree, prefix_len: int,
                hidden: bool, riders: tuple[Rider, ...] = ()):
    """`verify_trees` of one sequence over a dynamic cache: logits (N + 1, V), with `hidden` and the hidden states."""
    tokens = torch.cat([root.view(1), tree.tokens])  # (N+1,)
    positions = position_ids(tree.depths, prefix_len)  # (N+1,)
    keys = prefix_len + len(tree) + 1
    if len(tree) == 0:
        allowed = None  # the root alone: the model's own causal mask
    elif tree.chain:  # a chain of draws: causal after the prefix (2 ops)
        allowed = torch.ones(len(tree) + 1, keys, dtype=torch.bool, device=tokens.device).tril(prefix_len)  # (N+1, K)
    else:
        allowed = tree_attention_mask(tree.parents, prefix_len, tree.block)  # (N+1, K)
    return masked_forward(target, cache, tokens, positions, allowed, hidden,
                          keys=lambda: key_positions(prefix_len, positions, keys), riders=riders)


class TreeVerifier:
    """A KV model's verification step: `logits` runs one forward over each row's [root] + tree under its
    tree mask (`verify_trees`); `commit` compacts each row's cache to its root and accepted path. The
    other kind is `opttree.step.chains.ChainVerifier` (state layers, attention on key indices); both take the same calls."""

    rows = None  # how many sequences it verifies at once (None: any)

    def __init__(self, target: PreTrainedModel, hidden: bool = False, width: int = 0):
        self.target, self.hidden, self.width = target, hidden, width

    def logits(self, cache: Cache, roots: list[torch.Tensor], trees: list[DraftTree], prefix_lens: list[int],
               riders: tuple[Rider, ...] = ()) -> list:
        """Per row, (N + 1, V) logits at [root] + nodes; with `hidden`, (logits, every layer's (N + 1, H) states).
        `riders`: prompts prefilled in the same forward (`lean.Rider`)."""
        return verify_trees(self.target, cache, roots, trees, prefix_lens, self.hidden, self.width, riders=riders)

    def commit(self, cache: Cache, roots: list[torch.Tensor], trees: list[DraftTree], accepted: list[torch.Tensor],
               prefix_lens: list[int], firsts: list[bool] | None = None) -> None:
        """Per row, keep the root and the accepted nodes (A,) in the cache, in order; drop the rest of the tree.
        A row that accepted nothing keeps its root, the first of its step's rows, and a row whose accepted nodes are
        known on the host to be its first A (`firsts`; a chain of draws always) the first A + 1 rows: those rows stay
        where they are."""
        firsts = firsts or [False] * len(trees)
        keeps = [torch.cat([path.new_zeros(1), path + 1]) if path.shape[0] and not (tree.chain or first)
                 else path.shape[0] + 1 for tree, path, first in zip(trees, accepted, firsts)]  # offsets, or a count
        compact_rows(cache, prefix_lens, max(prefix_lens), keeps)


def greedy_choice(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (...,) the float32 argmax, as transformers' greedy search takes it (the first of
    equal maxima). Through `max(dim)`, which returns that same first index (documented, and tested against
    argmax on tie-heavy rows) at a third of argmax's time on a CPU (33 x 8192: 58 against 176 us)."""
    return as_float32(logits).max(dim=-1).indices


def matching_path(tree: DraftTree, choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follow, from the root, the children whose token equals the target's choice at their parent; on
    the device, nothing read back.

    choice: (N + 1,) the target's token at [root] + nodes (argmax for greedy, one sample per node for
    stochastic verification of deterministic candidates). Siblings carry distinct tokens, so a node has at
    most one matching child (`_reached_path`). Returns (path (N,): accepted node indices root->leaf in the
    first `length` entries, the rest 0; length () long; bonus token ()).
    """
    if len(tree) == 0:
        return tree.parents, torch.zeros((), dtype=torch.long, device=choice.device), choice[0]
    matches = tree.tokens == choice[tree.parents + 1]  # (N,) a child is its parent's choice
    path, length, row = _reached_path(tree, matches)
    return path, length, choice[row]


def _reached_path(tree: DraftTree, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chosen: (N,) bool, at most one chosen child per node. A node is reached when it and every ancestor
    are chosen: the reached nodes form one path from the root, and its deepest node is the accepted leaf.
    Returns (path (N,): its nodes root->leaf in the first `length` entries, the rest 0; length () long; the
    leaf's row () among [root] + nodes, 0 = the root), on the device."""
    n, device = len(tree), chosen.device
    ancestors = tree.ancestors  # (N, N), shared with the verify mask
    reached = ~(ancestors & ~chosen[None, :]).any(dim=1)  # (N,) every node on the root->node path is chosen
    length, leaf = torch.where(reached, tree.depths, 0).max(dim=0)  # (), (): the deepest reached node
    on_path = ancestors[leaf] & (length > 0)  # (N,)
    slots = torch.where(on_path, tree.depths - 1, n)  # (N,) position on the path; n = off it
    path = torch.zeros(n + 1, dtype=torch.long, device=device).scatter_(0, slots, torch.arange(n, device=device))[:n]
    return path, length, torch.where(length > 0, leaf + 1, 0)


def accept_sampled(tree: DraftTree, logits: torch.Tensor, warp: Warp, noise: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stochastic verification of deterministic (top-k) candidates: at every node, one sample y of the
    target's warped distribution (the exponential race with the noise of the position y would take),
    then the walk from the root that descends to the child whose token is its parent's y
    (`matching_path`); the bonus is the y of the deepest node reached.

    Exact: the walk visits one node per depth and so uses each position's noise once; every emitted
    token is a fresh sample of the target at its prefix, as plain sampling draws it. logits: (N + 1, V);
    noise: (N + 1, V) log Exp(1) noise of the position each row's sample would take (`PositionNoise`).
    Returns (path (N,), length (), bonus ()) as `matching_path`, on the device.
    """
    return matching_path(tree, sampled_choice(logits, warp, noise))


def sampled_choice(logits: torch.Tensor, warp: Warp, noise: torch.Tensor) -> torch.Tensor:
    """(N + 1,) one sample of the target's warped distribution at each of [root] + nodes (`accept_sampled`)."""
    if warp.filters:
        return race(warp_logits(logits, warp), noise)  # (N+1,)
    # temperature alone: argmax(logits / T - log E) = argmax(logits - T log E), one fused op
    return torch.sub(logits, noise, alpha=warp.temperature).max(dim=-1).indices  # (N+1,) as `race` does


def accept_path(
    tree: DraftTree, logits: torch.Tensor, config: SpecConfig, generator: torch.Generator | None,
    noise: PositionNoise | None = None, root_position: int = 0, siblings: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verifier that is exact for the way the tree's candidates were chosen (docs/METHODS.md, "Tree policies").
    logits: (N + 1, V) at [root] + nodes; the root sits at `root_position`; `noise` serves sampled
    verification of deterministic candidates (made from `generator` if not given); `siblings`: how many
    sampled children of a node rejection sampling tries (`accept_rejection_sampling`). Returns (path (N,):
    the accepted node indices root->leaf in its first `length` entries; length () long; bonus ()).
    Nothing is read back, but where rejection sampling walks the path on the host (on a CPU)."""
    choice = target_choice(tree, logits, config, generator, noise, root_position)
    if choice is not None:
        return matching_path(tree, choice)
    return accept_rejection_sampling(tree, logits, generator, siblings, config.warp)


def target_choice(
    tree: DraftTree, logits: torch.Tensor, config: SpecConfig, generator: torch.Generator | None,
    noise: PositionNoise | None = None, root_position: int = 0,
) -> torch.Tensor | None:
    """(N + 1,) the target's token at [root] + nodes where acceptance matches the tree against them (deterministic
    candidates: the greedy argmax, or one sample a node by the exponential race, `accept_sampled`); None where the
    tree's children were sampled from the draft (recursive rejection sampling, `accept_rejection_sampling`)."""
    if tree.draft_probs is not None:
        return None
    if config.greedy:
        return greedy_choice(logits)
    noise = noise or PositionNoise(generator, logits.device)
    depths = torch.cat([tree.depths.new_zeros(1), tree.depths])  # (N+1,) root first
    rows = noise.rows(root_position + 1, depths, len(tree) + 1, logits.shape[-1])  # (N+1, V)
    return sampled_choice(logits, config.warp, rows)


def match_on_host(tokens: list[int], parents: list[int], choice: list[int]) -> tuple[list[int], int]:
    """`matching_path` on the host, for a tree read back whole: (the accepted node indices root -> leaf, the bonus).
    tokens, parents: the N nodes (parents before children, -1 = the root); choice: the target's N + 1 tokens at
    [root] + nodes. A node is reached when its parent is (the root always is) and its token is the parent's choice."""
    reached, path = [False] * len(tokens), []
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        if (parent < 0 or reached[parent]) and token == choice[parent + 1]:
            reached[i] = True
            path.append(i)
    return path, choice[path[-1] + 1 if path else 0]


def _as_path(n: int, accepted: torch.Tensor, bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A,) accepted nodes -> (path (N,) padded with 0, length (), bonus ())."""
    path = torch.cat([accepted, accepted.new_zeros(n - accepted.shape[0])])
    return path, torch.tensor(accepted.shape[0], device=accepted.device), bonus


def rejection_on_device(device: torch.device) -> bool:
    """Where recursive rejection sampling decides (`accept_rejection_sampling`): on the device (every node at
    once, nothing read back) everywhere but on a CPU, where walking the accepted path on the host is the faster
    (the walk visits ~A nodes, deciding every node costs N x V a sibling rank: 0.26 against 2.1 ms a step on
    the shipped pair at temperature 1, budget 8, 2-core Xeon; docs/BENCHMARKS.md). `OPTTREE_REJECTION=device`
    or `=host` forces one (tests run both)."""
    forced = os.environ.get("OPTTREE_REJECTION", "auto")
    return forced == "device" or (forced != "host" and device.type != "cpu")


def accept_rejection_sampling(
    tree: DraftTree, target: torch.Tensor, generator: torch.Generator | None, siblings: int | None = None,
    warp: Warp | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling for children *sampled* from the draft without replacement, with
    deterministic candidates (`tree.proposed`) under the same nodes tried first.

    target: (N + 1, V) target distributions (after the warpers) at [root] + nodes, or with `warp` the target's
    logits there, warped where needed (the host walk: only the rows it visits); tree.draft_probs: (N + 1, V) the draft distributions the children were sampled from.
    At each node: first the deterministic children, by matching: one draw y ~ p, and the child whose
    token is y is accepted; if none is, p <- norm(p without those tokens). Then the sampled children in
    draw order: accept x with min(1, p(x) / q(x)); on rejection p <- norm(max(p - q, 0)), q(x) <- 0,
    q <- norm(q). If no child is accepted, the bonus is sampled from p. (Why this is exact:
    docs/METHODS.md, "OPT-Tree with sampled children".)
    Sampled siblings must be stored in the order they were drawn; whether a node got another child may
    depend on its earlier children but never on the token drawn for it. Decided on the host along the path
    (`_walk`) or on the device for every node at once (`_decide`), as `rejection_on_device` says.
    Returns (path (N,): the accepted nodes root -> leaf in its first `length` entries, length () long, bonus ()).
    """
    assert tree.draft_probs is not None, "rejection sampling needs the draft distributions"
    probs = (lambda rows: target[rows]) if warp is None else (lambda rows: target_probs(target[rows], warp))
    if tree.chain and os.environ.get("OPTTREE_BLOCK", "1") != "0":  # a chain of draws: verified as one block
        return accept_block(tree, probs(slice(None)), generator)
    if rejection_on_device(target.device):
        return _decide(tree, probs(slice(None)), generator, siblings)
    return _as_path(len(tree), *_walk(tree, lambda row: probs(slice(row, row + 1)), generator))


def accept_block(tree: DraftTree, target: torch.Tensor, generator: torch.Generator | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block verification of a chain of draws (`tree.chain`; the rule: `block_rule`): from the deepest node up, node i
    ends the accepted block with probability h_i, and the bonus comes from that length's residual. target: (N + 1,
    V) the target's distributions at [root] + nodes. Vectorised, nothing read back. Returns (path (N,), length (),
    bonus ()) as `accept_rejection_sampling`."""
    n, device = len(tree), target.device
    ends, rows = block_rule(target.float(), tree.draft_probs[:n].float(), tree.tokens)  # (N,), (N + 1, V)
    stops = torch.rand(n, generator=generator, device=device) < ends  # (N,)
    length = torch.where(stops, torch.arange(1, n + 1, device=device), 0).max() if n else \
        torch.zeros((), dtype=torch.long, device=device)
    row = rows[length][None]  # (1, V)
    row = torch.where(row.sum() > 0, row, target[length][None].float())  # p_i == q_i up to rounding: nothing left
    return torch.arange(n, device=device), length, _draw(row, generator)[0]


def block_rule(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification's rule (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025) for a
    chain x_1 .. x_N, x_i drawn from q[i - 1] (N, V); p (N + 1, V): the target's distributions after 0 .. N of them.

    Token-level verification accepts each x_i on its own, with min(1, p(x_i) / q(x_i)). Block verification carries a
    weight along the chain, w_0 = 1, w_i = min(1, w_(i-1) p[i-1](x_i) / q[i-1](x_i)), so a token the target likes
    more than the draft pays for a later one it likes less. Returns ends (N,): [i - 1] = h_i, the probability that
    the accepted block ends at x_i given it does not end deeper (h_N = w_N; below, r_i / (r_i + 1 - w_i) with r_i
    the mass of max(w_i p[i] - q[i], 0)); and rows (N + 1, V): where the bonus comes from after i accepted tokens,
    max(w_i p[i] - q[i], 0) unnormalised (after all N: p[N]). The emitted tokens follow the target exactly, and the
    expected accepted length is never below token-level verification's (the paper proves both; the tests check
    both by enumeration)."""
    n = tokens.shape[0]
    x = tokens[:, None]  # (N, 1)
    ratio = (p[:n].gather(1, x).log() - q.gather(1, x).log()).squeeze(1)  # (N,) log p(x_i) / q(x_i)
    total = torch.cat([ratio.new_zeros(1), ratio.cumsum(0)])  # (N + 1,)
    w = (total - total.cummax(0).values).exp()  # (N + 1,) w_i = min(1, w_(i-1) ratio_i), as a clamped running sum
    residual = (w[:n, None] * p[:n] - q).clamp(min=0)  # (N, V)
    mass = residual.sum(dim=1)  # (N,) r_0 .. r_(N-1)
    ends = mass / (mass + 1 - w[:n]).clamp(min=torch.finfo(mass.dtype).tiny)  # (N,) h_0 .. h_(N-1)
    return torch.cat([ends[1:], w[n:]]), torch.cat([residual, p[n:]])


def _walk(tree: DraftTree, target_p: Callable[[int], torch.Tensor],
          generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_rejection_sampling` on the host: from the root, each visited node's children tried in order, one
    read of the tree and one per child tried; `target_p(row)`: (1, V) the target's distribution at row `row` of
    [root] + nodes (made for the visited rows only). Returns (accepted node indices (A,), bonus token ())."""
    proposed = tree.proposed if tree.proposed is not None else torch.zeros_like(tree.tokens, dtype=torch.bool)
    tokens, parents, proposed, drawn = torch.stack([tree.tokens, tree.parents, proposed, tree.drawn]).tolist()
    children_of = _children_lists(parents)
    accepted: list[int] = []
    node = -1  # -1 = root
    while True:
        p, q = target_p(node + 1).float(), tree.draft_probs[node + 1 : node + 2].float()  # (1, V) each
        children = children_of[node + 1]
        fixed = [child for child in children if proposed[child]]
        if fixed:  # deterministic candidates: the target's own sample decides
            y = int(_draw(p, generator))
            hit = [child for child in fixed if tokens[child] == y]
            if hit:
                accepted.append(hit[0])
                node = hit[0]
                continue
            p = p.index_fill(1, torch.tensor([tokens[c] for c in fixed], device=p.device), 0.0)
            p = p / p.sum()
        draws = [child for child in children if drawn[child]]
        coins = torch.rand(len(draws), generator=generator, device=p.device).tolist()
        for child, coin in zip(draws, coins):
            x = tokens[child]
            q_x, p_x = torch.stack([q[0, x], p[0, x]]).tolist()  # one read
            if coin * q_x < p_x:  # accepted with probability min(1, p(x) / q(x))
                accepted.append(child)
                node = child
                break
            p, q = _rejected(p, q, torch.tensor([[x]], device=p.device))
        else:  # every child rejected (or none): the bonus comes from what is left of p
            bonus = _draw(p, generator)[0]
            return torch.tensor(accepted, dtype=torch.long, device=bonus.device), bonus


def _children_lists(parents: list[int]) -> list[list[int]]:
    """children_of[i + 1] = node indices whose parent is i (index 0 = the root), in node order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for child, parent in enumerate(parents):
        children[parent + 1].append(child)
    return children


def _decide(
    tree: DraftTree, target_p: torch.Tensor, generator: torch.Generator | None, siblings: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`accept_rejection_sampling` on the device, nothing read: every node decides at once, each with coins of
    its own (a node's choice depends on its own p, q and children only), one sibling rank a round; the accepted
    path is then followed from the root (`_reached_path`), and a node off it used coins no emitted token
    depends on. `siblings`: how many sampled children of a node are tried (host-known, so no read; default
    all); later ones count as never drawn, which is exact as long as the bound does not depend on this step's
    draws (the engine passes the most any of its earlier trees had: `StepReadout.siblings`)."""
    n, device = len(tree), target_p.device
    p, q = target_p.float(), tree.draft_probs.float()  # (N+1, V) each
    rows = tree.parents + 1  # (N,) each node's parent, as a row of p and q (0 = the root)
    chosen = torch.zeros(n + 1, dtype=torch.bool, device=device)  # [i] node i is its parent's accepted child; [n] dump
    decided = torch.zeros(n + 1, dtype=torch.bool, device=device)  # (N+1,) the row accepted a child
    if tree.proposed is not None:  # deterministic candidates: the target's own draw decides
        y = _draw(p, generator)  # (N+1,)
        hit = tree.proposed & (tree.tokens == y[rows])  # (N,) at most one per row: siblings' tokens differ
        chosen[:n] = hit
        decided = torch.zeros(n + 1, device=device).index_add_(0, rows, hit.float()) > 0
        fixed = torch.zeros_like(p).index_put_((rows, tree.tokens), tree.proposed.float(), accumulate=True) > 0
        p = p.masked_fill(fixed, 0.0)
        p = p / p.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)
    drawn = tree.drawn  # (N,)
    width = n if siblings is None else min(siblings, n)
    later = torch.ones(n, n, dtype=torch.bool, device=device).tril(-1)  # [i, j]: j comes before i
    rank = ((rows[:, None] == rows[None, :]) & later & drawn[None, :]).sum(dim=1)  # (N,) drawn siblings before it
    column = torch.where(drawn & (rank < width), rank, width)  # (N,) width = not tried
    child = torch.full((n + 1, width + 1), n, dtype=torch.long, device=device).index_put_(
        (rows, column), torch.arange(n, device=device))[:, :width]  # (N+1, width) node of each rank, n = none
    tokens = torch.cat([tree.tokens, tree.tokens.new_zeros(1)])  # (N+1,) [n]: a stand-in for "no child"
    coins = torch.rand(n + 1, width, generator=generator, device=device)  # (N+1, width)
    for j in range(width):
        node = child[:, j]  # (N+1,)
        x = tokens[node][:, None]  # (N+1, 1)
        tried = (node < n) & ~decided
        accepted = tried & (coins[:, j : j + 1] * q.gather(1, x) < p.gather(1, x)).squeeze(1)  # min(1, p(x) / q(x))
        chosen[node] |= accepted  # the dump slot n collects the rows without a j-th child
        decided |= accepted
        rejected = (tried & ~accepted)[:, None]
        p_next, q_next = _rejected(p, q, x)
        p, q = torch.where(rejected, p_next, p), torch.where(rejected, q_next, q)
    if n == 0:
        return tree.parents, torch.zeros((), dtype=torch.long, device=device), _draw(p, generator)[0]
    path, length, row = _reached_path(tree, chosen[:n])
    bonus = _draw(p[row][None], generator)[0]  # what is left of p at the leaf, after its children were rejected
    return path, length, bonus


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """(R, V) distributions -> (R,) one draw from each (`sampling.inverse_cdf`)."""
    return inverse_cdf(p, 1, generator).squeeze(1)


def _rejected(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """After rejecting draft token x (R, 1) of each row: p <- norm(max(p - q, 0)) (the target mass q did not
    cover), q <- norm(q without x) (the next child is drawn without replacement). (R, V), (R, V) -> same; a row
    where p - q leaves nothing (p == q up to rounding, where a rejection has probability ~0) keeps its p."""
    rest = (p - q).clamp(min=0)
    total = rest.sum(dim=-1, keepdim=True)
    p = torch.where(total > 0, rest / total.clamp(min=torch.finfo(p.dtype).tiny), p)
    q = q.scatter(1, x, 0.0)
    return p, q / q.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(q.dtype).tiny)
