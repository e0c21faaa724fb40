"""Any Hugging Face causal LM as the draft, with its own KV cache.

One forward per tree layer: the nodes of a layer attend to the committed prefix, to their own
ancestors and to themselves (an ancestor-only mask, never a stale sibling).

`temperature` divides the draft's logits before they become log-probabilities: a calibration of
p-hat (`opttree.alignment.fit_draft_temperature`). A small distilled draft is often under-confident
on the text its target writes, which makes every p-hat-driven tree too wide and too shallow. Any
value is lossless: trees of top-ranked tokens are verified by the target alone, and sampled trees
carry the distribution they were actually drawn from.
"""

from __future__ import annotations

from functools import lru_cache, partial

import torch
from transformers import PreTrainedModel

from ...device import constant, model_device, on, static_step
from ...settings.declared import Declared
from ..attention import key_positions, mask_layout
from ..cache import (
    capacity,
    compact,
    context_window,
    drop_front,
    grow,
    last_logits_only,
    new_cache,
    static_cache,
    static_capacity,
    truncate,
)
from ..chains import forward_chains, restore_layers, save_layers, state_cache, verified_as_chains
from ..draft_forward import draft_forward
from ..sampling import as_float32
from ..verify import Verification, masked_forward
from .together import current_round


def on_target_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """(..., Vd) draft logits -> (..., vocab) over the target's ids: a padded draft's extra columns are
    dropped, the ids a shorter draft lacks get -inf."""
    missing = vocab - logits.shape[-1]
    if missing == 0:
        return logits
    return torch.nn.functional.pad(logits, (0, missing), value=float("-inf")) if missing > 0 else logits[..., :vocab]


@lru_cache(maxsize=256)
def _identity_rows(size: int, start: int, end: int, device: torch.device) -> torch.Tensor:
    """Rows start .. end - 1 of the (size + 1, size) bool identity (its last row zero), a view made once (read only)."""
    return torch.eye(size + 1, size, dtype=torch.bool, device=device)[start:end]


class SlotTree:
    """A drafter's nodes of the current step, by slot: each one's depth and set of ancestors, kept in buffers that
    double when full (a layer's slots: seven ops, none sized by the tree). Slot i is row i of the buffer and its last
    row the root's (reaching nothing), so a parent slot of -1 (the root) indexes it as it is. A chain from the root
    (`add_child_of_last` only) is kept on the host and written into the buffers only if a tree's slots follow: a
    slice a node."""

    def __init__(self, device: torch.device, capacity: int = 32):
        self.device = device
        self.size = 0  # slots so far
        self.chained = 0  # the first slots, one chain from the root, not yet in the buffers (None: written)
        self._capacity = capacity
        self._reach = None  # (C + 1, C): [i, j] slot j is slot i or its ancestor, row C the root's; made for a tree

    def reset(self) -> None:
        """A new step's tree: no slots. The buffers stay (a slot's row is written whole when it is added)."""
        self.size, self.chained = 0, 0

    def _grow(self, capacity: int) -> None:
        """Buffers for `capacity` slots, holding the slots written so far."""
        reach = torch.zeros(capacity + 1, capacity, dtype=torch.bool, device=self.device)
        if self._reach is not None and self.size:
            reach[: self.size, : self.size] = self._reach[: self.size, : self.size]
        self._reach = reach
        self._capacity = capacity

    @property
    def depths(self) -> torch.Tensor:
        """(S,) the slots' depths: how many slots each reaches."""
        if self.chained is not None:  # a chain kept on the host: slot i at depth i + 1
            return _counting(max(self._capacity, self.size), self.device)[: self.size]
        return self._reach[: self.size].sum(dim=1)

    def _write_chain(self) -> None:
        """The chain kept on the host, into the buffers: every slot before slot i is its ancestor. Buffers made
        afresh for a chain (its rows are written in part) or the first tree."""
        if self.chained is None:
            return
        if self.chained or self._reach is None:
            self._reach = None
            self._grow(self._capacity)
        if self.chained:
            k = self.chained
            self._reach[:k, :k] = _lower(k, self.device)
        self.chained = None

    def add(self, parent_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K new slots with these parents (-1 = the root) -> (their depths (K,), the slots each one may
        attend to among the S + K (K, S+K): its ancestors and itself)."""
        self._write_chain()
        k, s = parent_slots.shape[0], self.size
        if s + k > self._capacity:
            self._grow(max(2 * self._capacity, s + k))
        own = _identity_rows(self._capacity, s, s + k, self.device)  # (K, C)
        if s == 0:  # the first slots: every parent is the root
            reach = self._reach[:k].copy_(own)
            self.size = k
            return constant((1,) * k, self.device), reach[:, :k]
        reach = self._reach[parent_slots] | own  # (K, C): the parent's (-1: the root's row, the last), and its own
        self._reach[s : s + k] = reach
        self.size = s + k
        return reach.sum(dim=1), reach[:, : s + k]

    def add_child_of_last(self) -> torch.Tensor:
        """One new slot under the last one (the root when none): a chain's next node. Its depth (1,) (read only)."""
        if self.chained is None:  # after a tree's slots: written like theirs
            return self.add(torch.full((1,), self.size - 1, dtype=torch.long, device=self.device))[0]
        self.size = self.chained = self.size + 1
        if self.size > self._capacity:
            self._capacity *= 2
        return _counting(self._capacity, self.device)[self.size - 1 : self.size]


def _slot_keys(base: int, slots: SlotTree, width: int) -> torch.Tensor:
    """(width,) the positions of a draft forward's keys: the committed ones below `base`, then the slots'."""
    return key_positions(base, base - 1 + slots.depths, width)


@lru_cache(maxsize=8)
def _counting(size: int, device: torch.device) -> torch.Tensor:
    """(size,) long 1, 2, ..., size, made once (read only)."""
    return torch.arange(1, size + 1, device=device)


@lru_cache(maxsize=64)
def _lower(size: int, device: torch.device) -> torch.Tensor:
    """(size, size) bool, True on and below the diagonal, made once (read only)."""
    return torch.ones(size, size, dtype=torch.bool, device=device).tril()


class ModelDrafter(Declared):
    forwards_together = True  # in a batch, its forwards run with the other rows' (`drafters.together`)
    runs_draft_forward = True  # runs the model by `draft_forward` where that applies (over a dynamic cache, as trees)
    extends_chains = True  # `extend`: a chain's next node, under the model's own causal mask

    def __init__(self, model: PreTrainedModel, temperature: float = 1.0, vocab: int | None = None,
                 window: int | None = None):
        """`vocab`: the target's vocabulary size, when the draft's embedding is padded (or shorter) over the
        same tokenizer; log-probabilities cover exactly these ids (default: the draft's own). `window`: the
        committed positions the draft attends to at most (`_slide`; None: all)."""
        if not (0 < temperature < float("inf")):
            raise ValueError(f"the draft temperature must be a finite number > 0, got {temperature!r}")
        self.model = model
        self.networks = (model,)
        self.device = model_device(model)  # inputs go here; log-probabilities come back from here
        self.temperature = temperature
        self.vocab = vocab
        self.rows = model.get_input_embeddings().weight.shape[0]  # ids the draft can embed
        self.embeds_all = vocab is not None and vocab <= self.rows  # every id of the target's (else `_embeddable`)
        self.cache = new_cache(self.model)
        self.committed_len = 0  # tokens of the committed sequence held in the cache
        self.base = 0  # committed length when the current tree was opened
        # fewer ops than the model's forward where it applies (None: the model's own)
        self.forward = draft_forward(model) if self.runs_draft_forward else None
        self.draft_window = window
        self.dropped = 0  # committed positions dropped from the cache's front (`_slide`): its row i = position dropped + i
        self.slots = SlotTree(self.device)
        self._open_tree()

    def _open_tree(self) -> None:
        self.slots.reset()

    def start(self, input_ids: torch.Tensor) -> None:
        self.cache = new_cache(self.model)
        self.committed_len = self.dropped = 0

    def root(self, committed: torch.Tensor) -> torch.Tensor:
        truncate(self.cache, self.committed_len - self.dropped)  # drop the slots of the previous tree
        return self._take(committed)

    def _take(self, committed: torch.Tensor) -> torch.Tensor:
        """The committed tokens the cache lacks through the draft; the root's log-probabilities (V,)."""
        end = committed.shape[0]
        self._slide(end)
        new = self._embeddable(on(committed[self.committed_len :], self.device))  # (R,) tokens the draft has not seen
        assert new.numel() > 0, "the root must be new to the drafter"
        self._positions_below(end)
        logits = self._root_forward(new, end)  # (V,)
        self.committed_len = self.base = end
        self._open_tree()
        return self._log_probs(logits)

    def _embeddable(self, tokens: torch.Tensor) -> torch.Tensor:
        """Ids the draft can embed: one past a shorter draft's rows (the target emitted it) goes in as the last row;
        only the draft's guesses depend on it, never the output. Unchanged (no op) where the draft embeds them all."""
        return tokens if self.embeds_all else tokens.clamp(max=self.rows - 1)

    def _slide(self, end: int) -> None:
        """Before the committed tokens up to `end` go in: where the cache would then hold more than `draft_window`
        positions, drop its oldest so that it holds 7/8 of the window after them (a drop every window / 8 positions;
        the rows left are views, no copy), the tokens before that left out. A draft trained on short windows drafts
        better over the context it was trained on; its rotary embedding sees only distances, so positions stay
        absolute (the shipped draft, trained on 512-token windows: docs/BENCHMARKS.md, "The draft over the context it
        was trained on")."""
        if self.draft_window is None or end - self.dropped <= self.draft_window:
            return
        first = end - self.draft_window * 7 // 8  # the first position the cache keeps
        drop_front(self.cache, min(first, self.committed_len) - self.dropped)
        self.dropped, self.committed_len = first, max(first, self.committed_len)

    def _positions_below(self, end: int) -> None:
        """The next forward's positions are below `end`: a sliding cache holds fewer keys than that, so the draft's
        rotary table must cover them (`RopeTable.reserve`; without a drop the keys' count does)."""
        if self.dropped and self.forward is not None:
            self.forward.rope.reserve(end)

    def expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
        tokens, parent_slots = self._embeddable(on(tokens, self.device)), on(parent_slots, self.device)
        depths, ancestors = self.slots.add(parent_slots)  # (K,), (K, S+K)
        held = self.base - self.dropped  # committed positions in the cache
        allowed = torch.cat([torch.ones(tokens.shape[0], held, dtype=torch.bool, device=self.device), ancestors],
                            dim=1)  # (K, held+S+K)
        # the keys' positions, for layers with a window (a sliding draft has none: `model_drafter`)
        keys = None if self.dropped else partial(_slot_keys, self.base, self.slots, allowed.shape[1])  # made if asked
        positions = self.base - 1 + depths  # (K,)
        self._positions_below(self.base + self.slots.size)
        logits = self._tree_forward(tokens, positions, allowed, keys)  # (K, V)
        return self._log_probs(logits)

    def extend(self, token: torch.Tensor) -> torch.Tensor:
        """`expand` of one node (1,) whose parent is the last slot (the root when none), every slot so far being its
        ancestor (a chain): it runs as the next token over the cache, no tree mask (on a 2-core CPU 219 against 268
        us for the shipped draft). Returns (1, V)."""
        token = self._embeddable(on(token, self.device))
        depths = self.slots.add_child_of_last()  # (1,)
        self._positions_below(self.base + self.slots.size)
        return self._log_probs(self._tree_forward(token, self.base - 1 + depths, None, None))  # (1, V): causal

    def _root_forward(self, new: torch.Tensor, end: int) -> torch.Tensor:
        """(R,) new committed tokens at positions committed_len .. end - 1 -> the last one's logits (V,)."""
        together = current_round() if self.forwards_together else None
        if together is not None:  # one forward with the other rows' (`drafters.together`)
            positions = torch.arange(self.committed_len, end, device=self.device)
            return together.submit(self.model, self.cache, new, positions, None, runner=self.forward)[-1]
        if self.forward is not None:
            positions = torch.arange(self.committed_len, end, device=self.device)[None]  # (1, R)
            out = self.forward(input_ids=new[None], position_ids=positions, cache=self.cache, logits_to_keep=1)
            return out.logits[0, -1]
        return forward_chains(self.model, self.cache, new[None], self.committed_len,
                              **last_logits_only(self.model))[0, -1]

    def _tree_forward(self, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None, keys
                      ) -> torch.Tensor:
        """(K,) slots at (K,) positions under (K, base+S+K) `allowed` (None: causal), after the cache -> logits
        (K, V)."""
        together = current_round() if self.forwards_together else None
        if together is not None:  # one forward with the other rows' (`drafters.together`)
            return together.submit(self.model, self.cache, tokens, positions, allowed, keys, self.forward)
        if self.forward is not None:  # `draft_forward` (full attention everywhere) broadcasts a (K, keys) mask itself
            return self.forward(input_ids=tokens[None], position_ids=positions[None], attention_mask=allowed,
                                cache=self.cache).logits[0]
        return masked_forward(self.model, self.cache, tokens, positions, allowed, keys=keys)

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., Vd) logits in the model's dtype -> (..., V) float32 log-probabilities at the draft temperature
        over the target's V ids: a padded draft's extra columns are dropped (the rest renormalised), the
        ids a shorter draft lacks get -inf."""
        logits = as_float32(logits) if self.vocab is None else on_target_vocab(as_float32(logits), self.vocab)
        return torch.log_softmax(logits / self.temperature if self.temperature != 1 else logits, dim=-1)

    def observe(self, result: Verification) -> None:
        drafted = next((i for i, slot in enumerate(result.readout.slots) if slot < 0), len(result.readout.slots))
        # the drafted nodes of an accepted path form a prefix of it; their slots are known on the host: when
        # they are the first slots (nothing accepted, or the first slot alone), they stay where they are
        in_place = result.readout.slots[:drafted] == list(range(drafted))
        kept = drafted if in_place else result.accepted_slots[:drafted].to(self.device)
        compact(self.cache, self.base - self.dropped, kept)
        self.committed_len = self.base + drafted


class StaticModelDrafter(ModelDrafter):
    """The draft model over a preallocated cache (`opttree.step.cache.static_cache`), for a static-path
    generation. After the prompt, every forward is padded to a fixed number of rows over the cache's
    whole capacity, so a draft compiled for fixed shapes (`compile_model(draft)`) replays one graph per
    row count and capacity bucket (CUDA graphs on a GPU), whatever the prompt's length: a tree layer of
    K slots runs as the next power of two >= K rows, the new committed tokens of a step's root as
    `root_rows` (the longest accepted path and its root). The cache is sized for `positions` (the
    generation's length and a step's slots) and grows a bucket if that was short.

    A tree's attention pattern is kept in preallocated buffers, by slot: `keys_of[s]` (C,) the keys
    slot s attends to (the committed prefix, its ancestors and itself), `depth_of[s]`. A layer's slots
    copy their parents' rows and add themselves, and the forward takes the layer's rows as they are:
    a few ops a layer, none of them sized by the tree (what a GPU step pays for in launches). A padding
    row takes whatever its buffer row holds: every row attends to key 0 at least, and its output and
    keys are dropped."""

    forwards_together = False  # one preallocated sequence
    runs_draft_forward = False  # its fixed-shape step (`static_step`) runs it
    extends_chains = False  # its layers keep their fixed shapes (`expand`)

    def __init__(self, model: PreTrainedModel, temperature: float = 1.0, vocab: int | None = None, positions: int = 0,
                 root_rows: int = 1):
        super().__init__(model, temperature, vocab)
        self.positions, self.root_rows, self.window = positions, root_rows, context_window(model)
        self.keys_of = torch.ones(0, 0, dtype=torch.bool, device=self.device)  # (S_max, C) by slot
        self.depth_of = torch.zeros(0, dtype=torch.long, device=self.device)  # (S_max,)
        self.prefix = torch.zeros(0, dtype=torch.bool, device=self.device)  # (C,) the committed keys

    def _open_tree(self) -> None:
        self.filled = 0  # slots of the current tree

    def start(self, input_ids: torch.Tensor) -> None:
        self.cache = static_cache(self.model, static_capacity(max(self.positions, input_ids.shape[0]), self.window))
        self.committed_len = 0

    def root(self, committed: torch.Tensor) -> torch.Tensor:
        log_probs = super().root(committed)
        self._committed_keys()
        return log_probs

    def _committed_keys(self) -> None:
        self.prefix = torch.arange(capacity(self.cache), device=self.device) < self.base  # (C,)

    def _root_forward(self, new: torch.Tensor, end: int) -> torch.Tensor:
        if not self.cache.is_initialized:  # the prompt: one eager forward under the causal mask allocates the cache
            self._make_room(end)
            return super()._root_forward(new, end)
        start, count = self.committed_len, new.shape[0]
        width = max(self.root_rows, 1 << (count - 1).bit_length())  # W
        self._make_room(start + width)
        keys_total = capacity(self.cache)  # C
        pad = torch.arange(count, width, device=self.device)  # (W-R,) padding rows, after the real ones
        allowed = torch.ones(width, keys_total, dtype=torch.bool, device=self.device).tril(start)  # (W, C) causal
        allowed[pad, : start + count] = False  # a padding row sees itself only
        positions = torch.arange(start, end, device=self.device)  # (R,)
        logits = self._padded_forward(new, positions, allowed, partial(key_positions, start, positions, keys_total), end)
        return logits[count - 1]

    def expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
        tokens, parent_slots = self._embeddable(on(tokens, self.device)), on(parent_slots, self.device)
        count, first = tokens.shape[0], self.filled  # K new slots: first .. first + K - 1
        width = 1 << (count - 1).bit_length()  # W
        self._make_room(self.base + first + width)
        self._slot_room(first + width)
        slots = torch.arange(first, first + count, device=self.device)  # (K,)
        has_parent, parent = parent_slots >= 0, parent_slots.clamp(min=0)  # (K,), (K,)
        keys_of = torch.where(has_parent[:, None], self.keys_of[parent], self.prefix)  # (K, C) the ancestors' keys
        keys_of[torch.arange(count, device=self.device), self.base + slots] = True  # and its own
        self.keys_of[slots] = keys_of
        depths = torch.where(has_parent, self.depth_of[parent] + 1, 1)  # (K,)
        self.depth_of[slots] = depths
        self.filled += count
        keys_total = capacity(self.cache)

        def every_key() -> torch.Tensor:  # (C,) the prefix, the slots at their depths, unused rows as their index
            return key_positions(self.base, self.base - 1 + self.depth_of[: self.filled], keys_total)

        logits = self._padded_forward(tokens, self.base - 1 + depths, self.keys_of[first : first + width], every_key,
                                      self.base + self.filled)
        return self._log_probs(logits[:count])

    def _padded_forward(self, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, keys,
                        end: int) -> torch.Tensor:
        """(Q,) tokens at (Q,) positions, padded to the W rows of `allowed` (W, C), through the fixed-shape
        step; the cache then ends at `end` (the padding rows' keys go). Returns logits (W, V)."""
        pad = (0, allowed.shape[0] - tokens.shape[0])
        logits = masked_forward(self.model, self.cache, torch.nn.functional.pad(tokens, pad),
                                torch.nn.functional.pad(positions, pad), allowed, forward=static_step(self.model),
                                keys=keys)
        truncate(self.cache, end)
        return logits

    def _make_room(self, needed: int) -> None:
        """Cache rows up to `needed`."""
        if needed > capacity(self.cache):
            grow(self.cache, static_capacity(needed, self.window))

    def _slot_room(self, slots: int) -> None:
        """Tree buffers for `slots` slots, over the cache's capacity."""
        rows, keys_total = self.keys_of.shape
        if slots <= rows and keys_total == capacity(self.cache):
            return
        wider = torch.zeros(max(slots, 2 * rows), capacity(self.cache), dtype=torch.bool, device=self.device)
        wider[:, 0] = True  # no row attends to nothing (a padding row's output is dropped, never NaN)
        wider[:rows, :keys_total] = self.keys_of
        self.keys_of = wider  # (S_max, C)
        self.depth_of = torch.cat([self.depth_of, self.depth_of.new_zeros(wider.shape[0] - rows)])
        self._committed_keys()


class ChainDrafter(ModelDrafter):
    """A draft model that a tree mask cannot drive exactly (`opttree.step.chains.verified_as_chains`: state
    layers, attention on key indices): each expansion runs its K new nodes as a batch of chains [the path
    from the root to the node] over K copies of the committed cache, which is put back after. The cache
    only ever holds committed tokens; the accepted ones go in with the next root. Costs K x depth tokens
    and a copy of the cache per node where a tree forward costs K tokens."""

    forwards_together = False  # its chains replicate its own cache: one row at a time
    runs_draft_forward = False  # chains, over state caches
    extends_chains = False  # its cache holds committed tokens only (`expand` runs each path)

    def _open_tree(self) -> None:
        super()._open_tree()
        self.slot_tokens = torch.empty(0, dtype=torch.long, device=self.device)  # (S,) each slot's token

    def start(self, input_ids: torch.Tensor) -> None:
        self.cache = state_cache(self.model)
        self.committed_len = 0

    def root(self, committed: torch.Tensor) -> torch.Tensor:
        return self._take(committed)  # the cache holds exactly the committed tokens it has seen

    def expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
        tokens, parent_slots = self._embeddable(on(tokens, self.device)), on(parent_slots, self.device)
        depths, ancestors = self.slots.add(parent_slots)  # (K,), (K, S+K)
        self.slot_tokens = torch.cat([self.slot_tokens, tokens])  # (S+K,)
        width = int(depths.max())  # one host read: the longest chain
        columns = (self.slots.depths - 1).clamp(max=width - 1).expand_as(ancestors)  # (K, S+K) a slot's column
        chains = torch.zeros(tokens.shape[0], width, dtype=torch.long, device=self.device).scatter_add_(
            1, columns, torch.where(ancestors, self.slot_tokens, 0))  # (K, width): one ancestor per depth
        saved = save_layers(self.cache)
        self.cache.reorder_cache(torch.zeros(tokens.shape[0], dtype=torch.long, device=self.device))  # K copies
        logits = forward_chains(self.model, self.cache, chains, self.base)  # (K, width, V)
        restore_layers(self.cache, saved)
        return self._log_probs(logits[torch.arange(tokens.shape[0], device=self.device), depths - 1])  # (K, V)

    def observe(self, result: Verification) -> None:
        pass  # the accepted tokens enter the cache with the next root


WINDOW_KEY = "opttree_draft_window"  # a draft's config.json may declare the window it drafts best over


def declared_window(model: PreTrainedModel) -> int | None:
    """The committed positions a draft declares it drafts best over (`WINDOW_KEY` in its config.json; the shipped draft,
    trained on 512-token windows, declares 256), or None."""
    window = model.config.to_dict().get(WINDOW_KEY)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"the draft's config.json declares {WINDOW_KEY}={window!r}: it must be an integer >= 1")
    return window


def model_drafter(model: PreTrainedModel, temperature: float = 1.0, vocab: int | None = None,
                  static_positions: int = 0, max_depth: int = 1, window: int | None = None) -> ModelDrafter:
    """A draft model's drafter: its trees under a tree mask, or as chains where a mask cannot drive it.
    `static_positions` > 0: a static-path generation's, over a preallocated cache of that many positions,
    its roots padded for accepted paths up to `max_depth` (`StaticModelDrafter`; chains keep
    transformers' own cache). `window`: the `draft_window` setting: None for the draft's declared window
    (`declared_window`) where it drafts over a dynamic cache, 0 for the whole context, else at most that many
    committed positions (`ModelDrafter`; a fixed-shape or chain drafter keeps every position, so a window asked for
    there is refused)."""
    chains = verified_as_chains(model)
    windowed = not chains and mask_layout(model.config).windowed  # a chain drafter's layers take no tree mask
    if window and (chains or static_positions or windowed):
        kind = "a draft driven as chains (state layers or attention on key indices)" if chains else \
            "the static path" if static_positions else "a draft with sliding-window layers (they keep their own)"
        raise ValueError(f"draft_window={window} applies to a draft model over a dynamic cache, not to {kind}: "
                         "drop draft_window (or pass 0)")
    if chains:
        return ChainDrafter(model, temperature, vocab=vocab)
    if static_positions:
        root_rows = 1 << max_depth.bit_length()  # the next power of two > max_depth: a path and its root
        return StaticModelDrafter(model, temperature, vocab=vocab, positions=static_positions, root_rows=root_rows)
    window = (None if windowed else declared_window(model)) if window is None else window or None
    return ModelDrafter(model, temperature, vocab=vocab, window=window)
