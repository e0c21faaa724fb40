"""KV caches: creation, the supported-model check, and compaction to the accepted path.

Two kinds, both touched only here: transformers' `DynamicCache` (per layer `.keys` / `.values` of
shape (batch, heads, seq, head_dim), grown by concatenation), and the static path's cache of
preallocated buffers (`static_cache`: every layer a (batch, heads, capacity, head_dim) buffer written
in place, so a step's shapes never change; what torch.compile and CUDA graphs need).
"""

from __future__ import annotations

import copy
import inspect
import math
from functools import lru_cache

import torch
from transformers import Cache, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer, StaticLayer

from ..device import host_tensor
from .attention import DRIVEN_LAYER_TYPES, INDEXED, POSITIONWISE_LAYER_TYPES, STATE_LAYER_TYPES
from .own_state import STATE_ARGUMENTS

MASKABLE_ATTENTION = ("sdpa", "eager")
# What a layer type that cannot be driven by tree attention really is (for the refusal's message).
LAYER_KINDS = {
    "linear_attention": "linear attention (a recurrent state)",
    "mamba": "state-space (Mamba) layers", "conv": "convolution state", "recurrent": "recurrent layers",
}


def has_indexed_attention(model: PreTrainedModel) -> bool:
    """Whether the model declares indexed sparse attention layers (their cache keeps the indexer's keys)."""
    return INDEXED in (getattr(model.config.get_text_config(), "layer_types", None) or [])


class GrowingLayer(DynamicLayer):
    """transformers' dynamic layer without its copy per forward. `DynamicLayer.update` concatenates, so
    every forward copies the layer's whole cache: with a 1,536-token prompt, torch.profiler counted that
    copy at a third of a plain decoding step on a 2-core CPU, more than the linear layers
    (docs/BENCHMARKS.md, "Long prompts").
    Here keys and values live in buffers with room to grow (a quarter more than needed, at least
    `HEADROOM` positions), new states are written after the cached ones in place, and `.keys` /
    `.values` are views of the buffers' first positions, so everything that reads or narrows them (crop,
    compaction) works as on transformers' layer. Where something else replaced them (`reorder_cache`,
    batch stacking or selection), the next update moves the new tensors into buffers of their own.
    Writes land only past the cached length, so a view taken before an update keeps its values. Inside a
    torch.compile'd forward the update concatenates as transformers' does (one graph, no break)."""

    HEADROOM = 64

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._store: tuple[torch.Tensor, torch.Tensor] | None = None  # (B, H, capacity, Dh) keys, values
        self._arena: Arena | None = None  # the buffer its cache's layers share, where they do (`shared_buffer`)

    def __copy__(self):
        """A copy shares no buffer with this layer (it would write into this layer's): it gets its own at
        its next update."""
        twin = type(self).__new__(type(self))
        vars(twin).update(vars(self))
        twin._store = twin._arena = None
        return twin

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():  # a compiled forward (dynamic shapes) concatenates, in its graph:
            return super().update(key_states, value_states)  # the checks below read storage, a graph break
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        if not self._writes_in_place(key_states, length + new):
            if self._arena is not None and self._arena.grows(self, key_states, length + new):
                self._arena.grow(length + new)  # every layer's buffers at once, in one larger shared buffer
            else:
                self._rebuffer(key_states, value_states, length + new)
        for buffer, states in zip(self._store, (key_states, value_states)):
            buffer.narrow(2, length, new).copy_(states)
        self.keys, self.values = (buffer.narrow(2, 0, length + new) for buffer in self._store)
        return self.keys, self.values

    def _writes_in_place(self, states: torch.Tensor, needed: int) -> bool:
        """Whether `needed` positions fit in this layer's buffers and `.keys` / `.values` are still views of
        them (host metadata only) for a batch of `states`' shape."""
        if self._store is None or self._store[0].shape[2] < needed:
            return False
        return self.holds_views() and self._store[0].shape[:2] == states.shape[:2]

    def holds_views(self) -> bool:
        """Whether `.keys` / `.values` are views of this layer's buffers' first positions."""
        return self._store is not None and all(
            view is not None and view.data_ptr() == buffer.data_ptr() and view.stride() == buffer.stride()
            and view.dim() == 4 and view.shape[:2] == buffer.shape[:2] and view.shape[3] == buffer.shape[3]
            and view.dtype == buffer.dtype for view, buffer in zip((self.keys, self.values), self._store))

    def drop_front(self, count: int) -> None:
        """Drop the first `count` cached positions, keeping the rest where they are: the buffers become what is left
        of them (views, no copy), new states still written in place after the cached ones."""
        keys, values = (buffer.narrow(2, count, buffer.shape[2] - count) for buffer in self._store)
        self.hold(keys, values, self.get_seq_length() - count)

    def hold(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Take these (B, H, capacity, Dh) tensors as the buffers, the first `length` positions cached."""
        self._store = (keys, values)
        self.keys, self.values = keys.narrow(2, 0, length), values.narrow(2, 0, length)

    @classmethod
    def room(cls, needed: int) -> int:
        """Positions a buffer gets when `needed` must fit: a quarter more, at least HEADROOM."""
        return needed + max(cls.HEADROOM, needed // 4)

    def _rebuffer(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        """New buffers with room for `needed` positions and more, holding the cached states."""
        length, room = self.get_seq_length(), self.room(needed)
        dtype = self.keys.dtype if length else key_states.dtype  # a cache kept in float32 stays so (`stack_rows`)
        buffers = []
        for cached, states in zip((self.keys, self.values), (key_states, value_states)):
            buffer = states.new_empty((*states.shape[:2], room, states.shape[3]), dtype=dtype)  # (B, H, room, Dh)
            if length:
                buffer.narrow(2, 0, length).copy_(cached)
            buffers.append(buffer)
        self._store = tuple(buffers)


# On a CPU a buffer past glibc's largest mmap threshold (32 MiB) is memory mapped and faulted in afresh at every
# allocation, never reused from the heap (a new 65 MiB buffer: 18 ms on a 2-core AMD EPYC, eight times its copy):
# there layers keep buffers of their own, which the heap reuses (a batch's cache made anew as requests join).
CPU_SHARED_BYTES = 32 << 20


def can_share(shape: tuple, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an `Arena` of this shape is made (a CPU buffer at most CPU_SHARED_BYTES)."""
    return device.type != "cpu" or math.prod(shape) * dtype.itemsize <= CPU_SHARED_BYTES


class Arena:
    """One buffer holding every layer's keys and values, (2L, B, H, capacity, Dh): layer i's keys at 2i, its values at
    2i + 1, each layer's `_store` views of them. Compaction then moves all layers' rows in one gather and one copy,
    and the layers outgrow it together (one copy into a larger one, as many bytes as a buffer a layer)."""

    def __init__(self, buffer: torch.Tensor, layers: list[GrowingLayer], length: int):
        """Take `buffer` (2L, B, H, capacity, Dh) as these layers' keys and values, the first `length` positions
        cached (already written there)."""
        self.buffer, self.layers = buffer, layers
        self.stores: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(layers)  # layer i's, while it holds
        self._hold([length] * len(layers))

    @classmethod
    def gather(cls, layers: list[GrowingLayer]) -> "Arena":
        """One buffer of the layers' buffers' shape, their cached states copied in (one copy)."""
        like, length = layers[0]._store[0], layers[0].keys.shape[2]  # (B, H, capacity, Dh)
        buffer = like.new_empty((2 * len(layers), *like.shape))
        for i, layer in enumerate(layers):
            buffer[2 * i].narrow(2, 0, length).copy_(layer.keys)
            buffer[2 * i + 1].narrow(2, 0, length).copy_(layer.values)
        return cls(buffer, layers, length)

    def _hold(self, lengths: list[int | None]) -> None:
        """Layer i's buffers made views of this buffer, `lengths[i]` positions cached (None: it left, untouched)."""
        for i, (layer, length) in enumerate(zip(self.layers, lengths)):
            if length is not None:
                layer.hold(self.buffer[2 * i], self.buffer[2 * i + 1], length)
                layer._arena, self.stores[i] = self, layer._store

    def holds(self, layer: GrowingLayer) -> bool:
        """Whether `layer` still keeps its keys and values here (host metadata only)."""
        i = next((i for i, mine in enumerate(self.layers) if mine is layer), None)
        return i is not None and layer._store is self.stores[i] and layer.holds_views()

    def holds_all(self, layers: list) -> bool:
        """Whether these are this buffer's layers, all still in it, cached to one length (host metadata only)."""
        return len(layers) == len(self.layers) and all(
            layer is mine and layer._store is store and layer.keys.data_ptr() == store[0].data_ptr()
            and layer.values.data_ptr() == store[1].data_ptr() and layer.keys.shape == layers[0].keys.shape
            for layer, mine, store in zip(layers, self.layers, self.stores))

    def grows(self, layer: GrowingLayer, states: torch.Tensor, needed: int) -> bool:
        """Whether `layer`, needing room for `needed` positions of a batch of `states`' shape, grows by growing this
        buffer (else it takes a buffer of its own, and leaves)."""
        return self.holds(layer) and layer._store[0].shape[:2] == states.shape[:2] \
            and can_share(self._wider(needed), self.buffer.dtype, self.buffer.device)

    def _wider(self, needed: int) -> tuple:
        return (*self.buffer.shape[:3], GrowingLayer.room(needed), self.buffer.shape[4])

    def grow(self, needed: int) -> None:
        """A larger buffer with room for `needed` positions and more (and for as many rows as this one had room
        for); the layers still here moved into it with their cached states (in the middle of a forward some are a step
        longer than others)."""
        lengths = [layer.get_seq_length() if self.holds(layer) else None for layer in self.layers]
        shape = self._wider(needed)
        rows = max(shape[1], self.buffer.stride(0) // max(1, self.buffer.stride(1)))  # its rows' room
        wider = self.buffer.new_empty((shape[0], rows, *shape[2:]))[:, :shape[1]]
        wider.narrow(3, 0, self.buffer.shape[3]).copy_(self.buffer)  # (2L, B, H, capacity, Dh)
        self.buffer = wider
        self._hold(lengths)

    def admit(self, parts: list[tuple[Cache, list[int]]], dtype: torch.dtype | None, longest: int, count: int) -> bool:
        """`stack_rows` into this buffer, whose layers are `parts[0]`'s (`_stack_in_place`): where it has room for
        `count` rows (a buffer with more rows than its batch: `stack_rows(rows_room=...)`, rows that left) and `longest`
        positions, in the dtype asked for, the other parts' rows written after its rows (every layer's), each row's
        padding up to `longest` zeroed. Returns whether it did."""
        buffer, rows = self.buffer, len(parts[0][1])  # (2L, B, H, capacity, Dh)
        row_size = math.prod(buffer.shape[2:])
        if dtype not in (None, buffer.dtype) or buffer.shape[3] < longest or buffer.stride(1) != row_size \
                or not buffer[0, 0].is_contiguous() or buffer.stride(0) < count * row_size \
                or buffer.storage_offset() + (buffer.shape[0] - 1) * buffer.stride(0) + count * row_size \
                > buffer.untyped_storage().nbytes() // buffer.element_size():
            return False
        end = self.layers[0].keys.shape[2]  # the positions its rows hold (their padding zeroed up to there)
        if end > longest:
            return False
        wide = buffer.as_strided((buffer.shape[0], count, *buffer.shape[2:]), buffer.stride(), buffer.storage_offset())
        wide[:, :rows].narrow(3, end, longest - end).zero_()  # its rows' new padding: finite
        for i in range(len(self.layers)):
            for slab, name in ((2 * i, "keys"), (2 * i + 1, "values")):
                _fill_rows(wide[slab], parts[1:], i, name, longest, row=rows)
        self.buffer = wide
        self._hold([longest] * len(self.layers))
        return True

    def select(self, rows: list[int], length: int) -> None:
        """Keep the batch rows `rows`, in that order, every layer cached to `length`. Rows in increasing order (rows
        leaving a batch) move down in place, a row a copy: a new buffer of a batch's size is memory the process
        maps and faults in afresh (on a CPU, 18 ms for 65 MB, eight times the copies)."""
        if rows == sorted(set(rows)):
            for k, row in enumerate(rows):
                if row != k:
                    self.buffer[:, k].copy_(self.buffer[:, row])
            self.buffer = self.buffer.narrow(1, 0, len(rows))  # (2L, R, H, capacity, Dh)
        else:
            self.buffer = self.buffer.index_select(1, torch.tensor(rows, device=self.buffer.device))
        self._hold([length] * len(self.layers))


def shared_buffer(cache: Cache) -> torch.Tensor | None:
    """A dynamic cache's keys and values, every layer's, as views of one (2L, B, H, capacity, Dh) buffer (`Arena`),
    so that compaction moves them all in one gather and one copy. Made at the first call (one copy of the cached
    states) and again where a layer has left it (`drop_front`, `select_rows`, a batch stacked anew replace
    buffers); None where the layers cannot share one: not all `GrowingLayer`s holding views of buffers of one
    shape and dtype, cached to one length (an empty or indexed layer)."""
    layers = cache.layers
    arena = layers[0]._arena if layers and isinstance(layers[0], GrowingLayer) else None
    if arena is not None and arena.holds_all(layers):
        return arena.buffer
    first = layers[0] if layers else None
    if not isinstance(first, GrowingLayer) or first._store is None \
            or not can_share((2 * len(layers), *first._store[0].shape), first._store[0].dtype, first._store[0].device):
        return None  # the size first: a large batch's cache, every step
    if not all(isinstance(layer, GrowingLayer) and layer.holds_views() for layer in layers):
        return None
    like, length = first._store[0], first.keys.shape[2]
    if any(store.shape != like.shape or store.dtype != like.dtype or layer.keys.shape[2] != length
           for layer in layers for store in layer._store):
        return None
    return Arena.gather(layers).buffer


def new_cache(model: PreTrainedModel | None = None, layer_types: list[str] | None = None) -> DynamicCache:
    """A cache of plain full-attention layers (`GrowingLayer`: transformers' dynamic layer, written in
    place). Sliding and chunked layers keep every key too: their windows are applied by the masks
    (`opttree.step.attention`), so the cache rolls back like any other. A model with indexed sparse
    attention gets, for those layers, transformers' layer that also keeps the indexer's keys (one per
    position, compacted with the rest: `sequence_tensors`). `layer_types`: those of a part of a model
    (e.g. an early-exit layer's copy of one target layer) instead of a model's."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    if layer_types is None and model is not None and has_indexed_attention(model):
        layer_types = model.config.get_text_config().layer_types
    if layer_types and INDEXED in layer_types:
        cache.layers = [DynamicIndexedLayer() if kind == INDEXED else GrowingLayer() for kind in layer_types]
    return cache


def sequence_tensors(layer) -> list[tuple[str, int]]:
    """A dynamic layer's tensors that hold one entry per position, with their sequence axis: keys and
    values (B, H, S, Dh), and an indexed layer's indexer keys (B, S, Di)."""
    parts = [("keys", 2), ("values", 2)]
    if isinstance(layer, DynamicIndexedLayer) and layer.is_indexer_initialized and layer.indexer_keys.numel():
        parts.append(("indexer_keys", 1))
    return parts


class RollbackLayer(StaticLayer):
    """transformers' static layer (preallocated buffers written in place at a length kept as a device
    tensor), plus what speculation needs and transformers' `StaticCache` lacks: compaction to the
    accepted path and rollback, both in place (no new buffer, no host sync)."""

    def keep(self, rows: torch.Tensor, dest: torch.Tensor, end: int) -> None:
        """Rows `rows` (K,) move to `dest` (K,); the layer then ends at `end`."""
        if not self.is_initialized:
            return
        self.keys.index_copy_(2, dest, self.keys.index_select(2, rows))  # (B, H, K, Dh), gathered first
        self.values.index_copy_(2, dest, self.values.index_select(2, rows))
        self.cumulative_length.fill_(end)

    def truncate(self, length: int) -> None:
        if self.is_initialized:
            self.cumulative_length.fill_(length)


MIN_STATIC_CAPACITY = 256


def static_capacity(positions: int, limit: int | None = None) -> int:
    """The capacity a static cache gets for a generation that needs `positions`: the next power of two
    (at least 256), so that generations of different lengths share the compiled step's shapes (a
    compilation per bucket, not per prompt), at the price of attention over up to 2x masked keys;
    never past `limit` (the model's context window: some models index buffers of that many keys)
    when the positions fit in it."""
    bucket = max(MIN_STATIC_CAPACITY, 1 << (positions - 1).bit_length())
    return limit if limit is not None and positions <= limit < bucket else bucket


def static_cache(model: PreTrainedModel, capacity: int) -> Cache:
    """A cache of `capacity` preallocated positions per layer (allocated at the first forward)."""
    layers = model.config.get_text_config().num_hidden_layers
    return Cache(layers=[RollbackLayer(max_cache_len=capacity) for _ in range(layers)])


def grow(cache: Cache, capacity: int) -> None:
    """A static cache's layers moved to buffers of `capacity` positions, their rows and lengths kept (a new
    capacity bucket: a compiled step compiles once more for it). In place."""
    for i, layer in enumerate(cache.layers):
        wider = RollbackLayer(max_cache_len=capacity)
        if layer.is_initialized:
            wider.lazy_initialization(layer.keys, layer.values)
            wider.keys[:, :, : layer.max_cache_len] = layer.keys
            wider.values[:, :, : layer.max_cache_len] = layer.values
            wider.cumulative_length.copy_(layer.cumulative_length)
        cache.layers[i] = wider


def is_static(cache: Cache) -> bool:
    return bool(cache.layers) and isinstance(cache.layers[0], RollbackLayer)


def capacity(cache: Cache) -> int:
    """How many positions a static cache holds (the key length of every forward over it)."""
    return cache.layers[0].max_cache_len


def last_logits_only(model: PreTrainedModel, rows: int = 1) -> dict:
    """Forward kwargs that compute logits for the last `rows` positions only, where the model supports
    it (a prompt's prefill needs few rows of the vocabulary projection, not one per token)."""
    return {"logits_to_keep": rows} if _takes_logits_to_keep(type(model)) else {}


@lru_cache(maxsize=None)
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword `model`'s forward takes its KV cache by: "cache" (transformers >= 5.24, which
    deprecates the old name with a FutureWarning) or "past_key_values" (before); "state" for a model that
    keeps its state outside transformers' cache by that name (`opttree.step.own_state`: RWKV). Decided per class.
    Pass a cache as `model(..., **{cache_argument(model): cache})`."""
    return _cache_argument(type(model))


@lru_cache(maxsize=None)
def _cache_argument(model_class: type) -> str:
    if getattr(model_class.config_class, "model_type", None) in STATE_ARGUMENTS:
        return STATE_ARGUMENTS[model_class.config_class.model_type]
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_len(cache: Cache) -> int:
    return int(cache.get_seq_length())  # a static layer keeps its length as a tensor


def compact(cache: Cache, start: int, keep: torch.Tensor | int) -> None:
    """Keep positions [0, start) and the rows `start + keep` (moved to start, start + 1, ...); drop the rest.

    keep: (K,) long offsets relative to `start`, increasing, or the number K for the first K rows (they
    stay where they are). In place; the cache ends at start + K.
    """
    compact_rows(cache, [start], start, [keep])


def compact_rows(cache: Cache, starts: list[int], source: int, keeps: list[torch.Tensor | int]) -> None:
    """Per row b of the batch: keep positions [0, starts[b]) and the rows `source + keeps[b]`, moved to
    starts[b], starts[b] + 1, ...; drop the rest. The cache then ends at the longest row's end; a
    shorter row's positions past its own end are padding that its masks never attend to.

    source: where the step's rows begin (the longest row's prefix; = starts[0] for one sequence).
    keeps: per row, (K_b,) long offsets relative to `source`, increasing; or the number K_b, for the
    offsets 0..K_b - 1 (a row whose kept rows are known on the host to be the first: with starts[b] ==
    source they stay where they are, and nothing of that row is copied). In place.
    """
    lengths = [keep if isinstance(keep, int) else keep.shape[0] for keep in keeps]
    end = max(start + length for start, length in zip(starts, lengths))
    in_place = [isinstance(keep, int) and start == source for keep, start in zip(keeps, starts)]
    if is_static(cache):  # one sequence, rows at its prefix; the indices made once for every layer
        assert len(starts) == 1 and source == starts[0], "a static cache holds one sequence"
        for layer in cache.layers if in_place[0] else ():
            layer.truncate(end)
        if not in_place[0]:
            rows = source + keeps[0]  # (K,)
            dest = torch.arange(source, end, device=rows.device)  # (K,)
            for layer in cache.layers:
                layer.keep(rows, dest, end)
        return
    moves = [(row, start, keep) for row, (start, keep, stays) in enumerate(zip(starts, keeps, in_place)) if not stays]
    move = _mover(moves, source, len(keeps) > 1, _device(cache))  # made once, for every layer
    arena = shared_buffer(cache)
    if arena is not None:  # every layer's keys and values at once: a handful of ops, whatever the layer count
        move(arena, 1, 3)  # (2L, B, H, capacity, Dh)
        if cache.layers[0].keys.shape[2] != end:
            views = arena.narrow(3, 0, end).unbind(0)  # 2L views (B, H, end, Dh)
            for i, layer in enumerate(cache.layers):
                layer.keys, layer.values = views[2 * i], views[2 * i + 1]
        return
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        for name, axis in sequence_tensors(layer):
            data = getattr(layer, name)  # (B, H, S, Dh) keys / values, (B, S, Di) indexer keys
            move(data, 0, axis)
            if data.shape[axis] != end:
                setattr(layer, name, data.narrow(axis, 0, end))


def _mover(moves: list[tuple[int, int, torch.Tensor | int]], source: int, batch: bool, device: torch.device):
    """moves: per moving row (row, start, its kept offsets after `source`: (K,) or the count K for 0..K - 1) -> a
    function that moves those positions of a tensor (batch axis, sequence axis) to start, start + 1, ... of their
    row, in place. One sequence: a gather and a copy. A batch: every row's at once, a gather and a scatter of the
    (M,) positions of all, whatever the row count (the indices made once, on the host where the counts say)."""
    if not moves:
        return lambda data, batch_axis, axis: None
    if not batch:
        (_, start, keep), = moves
        rows = source + (keep if isinstance(keep, torch.Tensor) else torch.arange(keep, device=device))  # (K,)

        def one(data: torch.Tensor, batch_axis: int, axis: int) -> None:
            data.narrow(axis, start, rows.shape[0]).copy_(data.index_select(axis, rows))  # the gather copies first
        return one
    counts = [keep.shape[0] if isinstance(keep, torch.Tensor) else keep for _, _, keep in moves]
    which = host_tensor([row for (row, _, _), k in zip(moves, counts) for _ in range(k)], device)  # (M,)
    dest = host_tensor([start + i for (_, start, _), k in zip(moves, counts) for i in range(k)], device)  # (M,)
    if all(isinstance(keep, int) for _, _, keep in moves):
        read = host_tensor([source + i for k in counts for i in range(k)], device)  # (M,)
    else:
        read = source + torch.cat([keep if isinstance(keep, torch.Tensor) else torch.arange(keep, device=device)
                                   for _, _, keep in moves])  # (M,)

    def every(data: torch.Tensor, batch_axis: int, axis: int) -> None:
        to = [slice(None)] * data.dim()
        to[batch_axis] = which
        frm = list(to)
        to[axis], frm[axis] = dest, read
        data[tuple(to)] = data[tuple(frm)]  # the gather copies first
    return every


def _device(cache: Cache) -> torch.device | None:
    """Where a cache's keys are (None: nothing cached)."""
    return next((layer.keys.device for layer in cache.layers if layer.keys is not None), None)


def stack_rows(parts: list[tuple[Cache, list[int]]], dtype: torch.dtype | None = None, rows_room: int = 0) -> Cache:
    """Caches of one or more sequences each, with their rows' lengths ((cache, [length of each row]); a
    length 0: nothing cached yet) -> one dynamic cache of all their rows in order, each padded at its end
    to the longest with zeros; the padding is never attended to (the tree masks). Each tensor is copied
    once, into a growing layer's buffers where the layer is one; only the positions up to the longest are written
    (a growing layer's room past them is written by its updates before any forward reads it). `dtype`: the keys and
    values kept in it (default: theirs), a growing layer's from then on (`opttree.step.lean.float32_attention`).
    `rows_room`: growing layers' buffers get room for this many rows (at least theirs), and where the first cache
    (the running batch's) has room for every row, the others are written into it (`_stack_in_place`), its rows left
    where they are: that cache is then the result."""
    longest = max(length for _, lengths in parts for length in lengths)
    filled = [cache for cache, lengths in parts if max(lengths)]
    if not filled:
        return new_cache()
    count = sum(len(lengths) for _, lengths in parts)
    if rows_room and _stack_in_place(parts, dtype, longest, count):
        return parts[0][0]
    first = filled[0].layers
    shared = None  # the stacked layers' keys and values in one buffer (`Arena`), where they can share one
    if first and all(isinstance(layer, GrowingLayer) and layer.keys is not None and layer.keys.numel()
                     and layer.keys.shape[1:] == layer.values.shape[1:] == first[0].keys.shape[1:]
                     and layer.keys.dtype == layer.values.dtype == first[0].keys.dtype for layer in first):
        like = first[0].keys  # (b, H, T, Dh)
        room = (2 * len(first), max(count, rows_room), like.shape[1], GrowingLayer.room(longest), like.shape[3])
        if can_share(room, dtype or like.dtype, like.device):  # (2L, B, H, R, Dh) of a buffer with room for more rows
            shared = like.new_empty(room, dtype=dtype or like.dtype)[:, :count]  # its first `longest` positions written
    layers = []
    for i, layer in enumerate(first):
        stacked = copy.copy(layer)  # the same kind of layer; a layer that shares another's keys stays empty
        if layer.keys is not None and layer.keys.numel():
            growing = isinstance(layer, GrowingLayer)
            stacks = {}
            for name, axis in sequence_tensors(layer):
                like = getattr(layer, name)  # (b, H, T, Dh) keys / values, (b, T, Di) indexer keys
                shape = [count, *like.shape[1:]]
                shape[axis] = GrowingLayer.room(longest) if growing else longest
                if shared is not None:
                    stack = shared[2 * i + (name == "values")]
                else:  # a growing layer's with room for `rows_room` rows (the first `count` used)
                    room = [max(count, rows_room) if growing else count, *shape[1:]]
                    stack = like.new_empty(room, dtype=dtype if growing and dtype is not None else like.dtype)[:count]
                _fill_rows(stack, parts, i, name, longest, axis)
                stacks[name] = stack
            if growing:
                stacked.hold(stacks["keys"], stacks["values"], longest)
            else:
                for name, stack in stacks.items():
                    setattr(stacked, name, stack)
        layers.append(stacked)
    if shared is not None:
        Arena(shared, layers, longest)
    cache = DynamicCache()
    cache.layers = layers
    return cache


def _stack_in_place(parts: list[tuple[Cache, list[int]]], dtype: torch.dtype | None, longest: int, count: int
                    ) -> bool:
    """`stack_rows` into the first cache's buffers, where they have room for `count` rows and `longest` positions, in
    the dtype asked for: the buffer its layers share (`Arena.admit`), or each growing layer's own: the other parts'
    rows written after its rows, each row's padding up to `longest` zeroed; its rows stay where they are (no copy).
    Returns whether it did."""
    first, lengths = parts[0]
    layers = first.layers
    arena = layers[0]._arena if layers and isinstance(layers[0], GrowingLayer) else None
    if arena is not None and max(lengths) and arena.holds_all(layers):
        return arena.admit(parts, dtype, longest, count)
    if not layers or not max(lengths) or any(
            not isinstance(layer, GrowingLayer) or layer._arena is not None or not layer.holds_views()
            or len(sequence_tensors(layer)) != 2
            or any(not _rows_fit(buffer, count, longest) or dtype not in (None, buffer.dtype)
                   for buffer in layer._store) for layer in layers):
        return False
    end = layers[0].keys.shape[2]  # the positions the first cache holds (its rows' padding zeroed up to there)
    if any(layer.keys.shape[2] != end for layer in layers) or end > longest:
        return False
    rows = len(lengths)
    for i, layer in enumerate(layers):
        stores = []
        for buffer, name in zip(layer._store, ("keys", "values")):  # (B, H, capacity, Dh)
            wide = buffer.as_strided((count, *buffer.shape[1:]), buffer.stride(), buffer.storage_offset())
            wide[:rows].narrow(2, end, longest - end).zero_()  # the first rows' new padding: finite
            _fill_rows(wide, parts[1:], i, name, longest, row=rows)
            stores.append(wide)
        layer.hold(*stores, longest)
    return True


def _fill_rows(stack: torch.Tensor, parts: list[tuple[Cache, list[int]]], i: int, name: str, longest: int,
               axis: int = 2, row: int = 0) -> None:
    """The rows of `stack` (B, ...) from `row` on, a part's after another: each part's layer i's `name` states
    ((b, H, T, Dh) keys / values, (b, T, Di) indexer keys) at their first positions along `axis`, zeros after them up
    to `longest` (padding: never attended to, but finite)."""
    for cache, lengths in parts:
        rows = stack[row:row + len(lengths)]
        states = getattr(cache.layers[i], name) if max(lengths) else None
        written = states.shape[axis] if states is not None else 0
        if written:
            rows.narrow(axis, 0, written).copy_(states)
        rows.narrow(axis, written, longest - written).zero_()
        row += len(lengths)


def _rows_fit(buffer: torch.Tensor, rows: int, positions: int) -> bool:
    """Whether a growing layer's buffer (B, H, capacity, Dh), contiguous, has `positions` and, in its storage past its
    B rows, room for `rows` rows (`stack_rows(rows_room=...)` left it)."""
    return buffer.is_contiguous() and buffer.shape[2] >= positions and \
        buffer.storage_offset() + rows * buffer.stride(0) <= buffer.untyped_storage().nbytes() // buffer.element_size()


def select_rows(cache: Cache, rows: list[int], lengths: list[int]) -> None:
    """Keep the batch rows `rows` (their positions: `lengths`), in that order; the cache then ends at the
    longest of them. In place: rows in increasing order (rows leaving) move down within a growing layer's buffers,
    which keep their room (for rows joining later: `stack_rows(rows_room=...)`); other orders, one copy."""
    end = max(lengths)
    arena = cache.layers[0]._arena if cache.layers and isinstance(cache.layers[0], GrowingLayer) else None
    if arena is not None and arena.holds_all(cache.layers):  # every layer's rows in one copy
        arena.select(rows, end)
        return
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        index = torch.tensor(rows, device=layer.keys.device)
        if isinstance(layer, GrowingLayer) and layer.holds_views():
            if rows == sorted(set(rows)):  # rows leaving: the others move down in place, a row a copy (room kept)
                for buffer in layer._store:
                    for k, row in enumerate(rows):
                        if row != k:
                            buffer[k].copy_(buffer[row])
                layer.hold(*(buffer.narrow(0, 0, len(rows)) for buffer in layer._store), end)
            else:
                layer.hold(*(buffer.index_select(0, index) for buffer in layer._store), end)
            continue
        for name, axis in sequence_tensors(layer):
            setattr(layer, name, getattr(layer, name).index_select(0, index).narrow(axis, 0, end))


def drop_front(cache: Cache, count: int) -> None:
    """Drop the first `count` cached positions of a dynamic cache (its row 0 then holds what was row `count`): views,
    no copy."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer) and layer.holds_views():
            layer.drop_front(count)
            continue
        for name, axis in sequence_tensors(layer):
            setattr(layer, name, getattr(layer, name).narrow(axis, count, getattr(layer, name).shape[axis] - count))


def truncate(cache: Cache, length: int) -> None:
    """Drop everything at and after `length`."""
    if is_static(cache):
        for layer in cache.layers:
            layer.truncate(length)
        return
    extra = cache_len(cache) - length
    if extra > 0:
        cache.crop(-extra)


def context_window(model: PreTrainedModel) -> int | None:
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_model(model: PreTrainedModel, role: str, max_len: int) -> None:
    """Refuse, with a clear message, models whose attention or cache the engine cannot drive exactly.

    max_len: the longest sequence this generation can reach (prompt + new tokens).
    """
    if model.device.type == "meta":
        raise ValueError(f"{role} model is on the meta device (its weights are not loaded): load or move it first")
    config = model.config.get_text_config()
    attn = model.config._attn_implementation
    if attn not in MASKABLE_ATTENTION:
        raise ValueError(
            f"{role} model uses attn_implementation={attn!r}, which cannot take the 4D tree attention mask; "
            f"load it with attn_implementation='sdpa' (or 'eager'), or call model.set_attn_implementation('sdpa')"
        )
    layer_types = getattr(config, "layer_types", None) or []
    # state layers run as chains (`opttree.step.chains`, checked by `certify`)
    odd = sorted(set(layer_types) - set(DRIVEN_LAYER_TYPES) - set(STATE_LAYER_TYPES) - set(POSITIONWISE_LAYER_TYPES))
    if odd:
        kinds = ", ".join(f"{t!r}: {LAYER_KINDS.get(t, 'not plain causal attention')}" for t in odd)
        raise NotImplementedError(
            f"{role} model ({type(model).__name__}) has layers of type {kinds}: tree attention cannot drive them "
            "exactly (or their state cannot be rolled back to the accepted branch), so tree speculation is not "
            "supported for it"
        )
