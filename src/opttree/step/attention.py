"""Which keys each layer type attends, on positions: a tree forward's mask for every layer type.

transformers 5 gives every layer type its own mask: full causal attention, a sliding window (a query
at position q sees the keys at positions q - W < k <= q) or chunked attention (the keys of q's chunk
of C positions), and a model with several layer types takes them as a dict {layer type: 4D mask}.
A tree forward's keys are not in position order: a node sits at the prefix length plus its depth
minus one, its siblings at the same position. So the window of a layer is applied here, on the
positions of queries and keys, to the tree's mask (`tree.tree_attention_mask`), not on row indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
# sparse attention whose learned indexer picks each query's top-k keys among those its mask allows
# (DeepSeek-V3.2, GLM-5, ...): a node's allowed keys are its branch's, so it picks what plain decoding
# picks; the indexer's keys live in the cache beside the layer's (`opttree.step.cache`)
INDEXED = "indexed_attention"
DRIVEN_LAYER_TYPES = (FULL, SLIDING, CHUNKED, INDEXED)  # the layer types a tree mask can drive exactly
# layer types that hold a recurrent or convolution state: a target's are verified as chains (`opttree.step.chains`);
# "hybrid" / "hybrid_sliding": Zamba 2's shared attention block, Inkling's attention over short convolutions;
# DeepSeek-V4's compressed attention: besides a sliding window of keys, its layers keep the tokens not yet
# pooled into a compressed entry and the entries pooled so far, a state that grows with the sequence
COMPRESSED = ("compressed_sparse_attention", "heavily_compressed_attention")
STATE_LAYER_TYPES = ("conv", "linear_attention", "mamba", "mamba2", "hybrid", "hybrid_sliding", *COMPRESSED)
# layer types that neither attend nor keep a state (a feed-forward block of their own, as in Nemotron-H):
# they act position by position, so any mask and any verification suits them
POSITIONWISE_LAYER_TYPES = ("mlp", "moe")


@dataclass(frozen=True)
class Window:
    """A layer type's limit, beyond causality, on the keys a query sees; in positions."""

    kind: str  # "sliding": k > q - size | "chunked": k // size == q // size
    size: int

    def keep(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """(Q,), (K,) positions -> (Q, K) bool, True where the key is inside the query's window."""
        q, k = query_positions[:, None], key_positions[None, :]
        if self.kind == "sliding":
            return k > q - self.size
        return torch.div(k, self.size, rounding_mode="floor") == torch.div(q, self.size, rounding_mode="floor")


@dataclass(frozen=True)
class MaskLayout:
    """How a model takes its attention mask: the window of each layer type (None: full attention), and
    whether it takes one mask per layer type (a dict) or one mask for every layer."""

    windows: dict[str, Window | None]
    per_type: bool

    @property
    def windowed(self) -> bool:
        return any(window is not None for window in self.windows.values())


def mask_layout(config) -> MaskLayout:
    """The layout of a model's (text) config. With `layer_types`, one window per type, as a dict when
    the types differ; without, one for every layer: the sliding window when `sliding_window` is set
    (and `use_sliding_window` is not False), as Mistral-style models apply it to all their layers."""
    types = [kind for kind in dict.fromkeys(getattr(config, "layer_types", None) or [])
             if kind not in POSITIONWISE_LAYER_TYPES]
    if types:
        windows = {kind: _window_of(config, kind) for kind in types}
        return MaskLayout(windows, per_type=len(set(windows.values())) > 1)
    size = getattr(config, "sliding_window", None)
    uses = isinstance(size, int) and getattr(config, "use_sliding_window", True) is not False
    return MaskLayout({FULL: Window("sliding", size) if uses else None}, per_type=False)


def _window_of(config, layer_type: str) -> Window | None:
    size = {SLIDING: getattr(config, "sliding_window", None),
            CHUNKED: getattr(config, "attention_chunk_size", None)}.get(layer_type)
    if layer_type not in DRIVEN_LAYER_TYPES:
        raise NotImplementedError(f"layer type {layer_type!r} cannot take a tree mask")  # check_model refuses first
    return Window("sliding" if layer_type == SLIDING else "chunked", size) if isinstance(size, int) else None


def layer_masks(layout: MaskLayout, allowed: torch.Tensor, query_positions: torch.Tensor,
                key_positions: Callable[[], torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
    """The tree mask `allowed` (Q, K) bool, True = attend, restricted to each layer type's window:
    one (Q, K) mask, or {layer type: (Q, K)} for a model that takes one per type. query_positions: (Q,);
    key_positions: returns the (K,) positions of the keys (called only when a window needs them).
    A query always sees itself, so no row is left without a key."""
    if not layout.windowed:
        return allowed
    keys = key_positions()  # (K,)
    masks = {kind: allowed if window is None else allowed & window.keep(query_positions, keys)
             for kind, window in layout.windows.items()}
    return masks if layout.per_type else next(iter(masks.values()))


def key_positions(start: int, positions: torch.Tensor, keys: int) -> torch.Tensor:
    """(K,) positions of a forward's K keys: the cache rows before `start` hold positions 0..start-1 in
    order (committed tokens: compaction keeps them so), the next rows hold `positions` (R,) (the root
    and the nodes, or a drafter's slots of this step), and any rows after them (a preallocated cache's
    unused rows, always masked) count as their index."""
    device = positions.device
    after = start + positions.shape[0]
    return torch.cat([torch.arange(start, device=device), positions, torch.arange(after, max(keys, after), device=device)])
