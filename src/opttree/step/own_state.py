"""Recurrent models whose state transformers keeps outside its cache layers, verified as chains (`opttree.step.chains`).

- RWKV's forward takes and returns `state`: five tensors (B, hidden, layers) (the feed-forward's and the
  attention's last input, and the attention's numerator, denominator and running maximum), which every
  layer reads and writes in place.
- MiniMax's forward takes only its own `MiniMaxCache`, whose lightning-attention layers keep their state
  (K^T V per head) in a list beside the cache's layers, which hold the softmax-attention layers' keys.
- xLSTM's forward takes its own `xLSTMCache`: each layer's mLSTM state (C, n, m), written in place.
- RecurrentGemma keeps its recurrent blocks' states (the short convolution's last inputs, the RG-LRU
  state) on the blocks themselves, one set per model, and restarts the convolution from zeros on any
  forward of several tokens.

RWKV, MiniMax and xLSTM continue their state as decoding does on a forward of several new tokens (RWKV's
and MiniMax's recurrences run token by token once a state is cached, xLSTM's chunked kernel starts from
it). RecurrentGemma's state is held per sequence by `RecurrentGemmaState` and put on the blocks for the
forwards that pass it (hooks on the model, set once); a forward of several tokens after the prefill runs
its recurrent blocks token by token, as decoding does.
These states carry the calls chain verification makes of a cache: replicate a row (`reorder_cache`, as new
tensors), `save` and `restore`.
"""

from __future__ import annotations

import contextvars
import functools
import sys
from functools import lru_cache

import torch
from transformers import PreTrainedModel


def layer_attributes(layer) -> dict:
    """A cache layer's attributes, its dicts of state tensors copied (the tensors themselves are not: every
    update of transformers' layers replaces or writes into tensors that `reorder_cache` made)."""
    return {name: dict(value) if isinstance(value, dict) else value for name, value in vars(layer).items()}


def put_back(layer, attributes: dict) -> None:
    vars(layer).clear()
    vars(layer).update(attributes)


class OwnState:
    """A state kept outside transformers' cache layers: `reorder_cache(rows)` makes new tensors, so what
    `save` returned stays as it was; `restore` puts it back."""

    def save(self):
        raise NotImplementedError

    def restore(self, saved) -> None:
        raise NotImplementedError


class RwkvState(list, OwnState):
    """RWKV's state for one sequence: [feed-forward shift, attention shift, numerator, denominator, max],
    each (B, hidden, layers), made as RWKV's forward makes it when none is given."""

    def __init__(self, model: PreTrainedModel):
        config = model.config
        shape = (1, config.hidden_size, config.num_hidden_layers)
        dtype = model.get_input_embeddings().weight.dtype  # the shifts hold inputs; the rest is float32
        super().__init__(torch.zeros(shape, dtype=dtype if i <= 1 else torch.float32, device=model.device)
                         for i in range(5))
        self[4] -= 1e30  # the running maximum starts far below any key, as in RWKV's own initial state

    def reorder_cache(self, rows: torch.Tensor) -> None:
        """Rows `rows` (R,) of the batch."""
        self[:] = [tensor.index_select(0, rows) for tensor in self]

    def save(self) -> list[torch.Tensor]:
        return list(self)

    def restore(self, saved: list[torch.Tensor]) -> None:
        self[:] = saved


@lru_cache(maxsize=None)
def _minimax_state_class() -> type:
    from transformers.models.minimax.modeling_minimax import MiniMaxCache  # imported only for a MiniMax model

    class MiniMaxState(MiniMaxCache, OwnState):
        """MiniMax's cache: softmax-attention layers (keys, values) and the lightning layers' states beside them."""

        def reorder_cache(self, rows: torch.Tensor) -> None:
            super().reorder_cache(rows)  # the attention layers' keys and values
            self.linear_cache = [state.index_select(0, rows) if isinstance(state, torch.Tensor) else state
                                 for state in self.linear_cache]

        def save(self) -> tuple[list[dict], list]:
            return [layer_attributes(layer) for layer in self.layers], list(self.linear_cache)

        def restore(self, saved: tuple[list[dict], list]) -> None:
            layers, self.linear_cache = saved
            for layer, attributes in zip(self.layers, layers):
                put_back(layer, attributes)

    return MiniMaxState


@lru_cache(maxsize=None)
def _xlstm_state_class() -> type:
    from transformers.models.xlstm.modeling_xlstm import xLSTMCache  # imported only for an xLSTM model

    class XLSTMState(xLSTMCache, OwnState):
        """xLSTM's cache: each layer's mLSTM state (C (B, heads, dqk, dv), n (B, heads, dqk), m (B, heads, 1)),
        written in place by every forward, and the count of tokens seen (a tensor, added to in place)."""

        def __init__(self, model: PreTrainedModel):
            super().__init__(model.config, 1, dtype=model.get_input_embeddings().weight.dtype, device=model.device)

        def reorder_cache(self, rows: torch.Tensor) -> None:
            self.rnn_state = {layer: tuple(t.index_select(0, rows) for t in state)
                              for layer, state in self.rnn_state.items()}

        def save(self) -> tuple[dict, torch.Tensor]:
            return dict(self.rnn_state), self.seqlen_offset.clone()

        def restore(self, saved: tuple[dict, torch.Tensor]) -> None:
            self.rnn_state, self.seqlen_offset = saved

    return XLSTMState


# whether the recurrent blocks of the forward now running continue a state (token by token) or start one
_CONTINUING: contextvars.ContextVar[bool] = contextvars.ContextVar("opttree_continuing", default=False)
BOUND = "_opttree_binds_recurrent_gemma_state"  # set on a model whose hooks are registered (copies keep both)


@lru_cache(maxsize=None)
def _recurrent_gemma_state_class() -> type:
    from transformers import DynamicCache  # the attention layers' keys and values, as the model's own forward makes

    class RecurrentGemmaState(DynamicCache, OwnState):
        """RecurrentGemma's cache for one sequence: its attention layers' keys and values, and its recurrent
        blocks' states [(convolution inputs (B, width, conv - 1), RG-LRU state (B, lru_width))], None until the
        prefill, put on the blocks for each forward given this cache (`_bind`) and read back after it."""

        def __init__(self, model: PreTrainedModel):
            super().__init__(config=model.config)
            self.blocks = _recurrent_blocks(model)
            self.states: list[tuple[torch.Tensor, torch.Tensor]] | None = None
            self.entered: contextvars.Token | None = None  # set while a forward given this cache runs
            _bind(model)

        def reorder_cache(self, rows: torch.Tensor) -> None:
            super().reorder_cache(rows)
            if self.states is not None:
                self.states = [(conv.index_select(0, rows), lru.index_select(0, rows)) for conv, lru in self.states]

        def save(self) -> tuple[list[dict], list | None]:
            return [layer_attributes(layer) for layer in self.layers], self.states and list(self.states)

        def restore(self, saved: tuple[list[dict], list | None]) -> None:
            layers, self.states = saved
            for layer, attributes in zip(self.layers, layers):
                put_back(layer, attributes)

        def enter(self) -> None:
            """Before a forward: this sequence's states on the blocks (none yet: the blocks start from zeros)."""
            if self.entered is not None:
                return
            for i, block in enumerate(self.blocks):
                block.conv1d_state, block.rg_lru.recurrent_states = self.states[i] if self.states else (None, None)
            self.entered = _CONTINUING.set(self.states is not None)

        def leave(self) -> None:
            """After it (or its error): the blocks' new states back into this cache."""
            if self.entered is None:
                return
            _CONTINUING.reset(self.entered)
            self.entered = None
            self.states = [(block.conv1d_state, block.rg_lru.recurrent_states) for block in self.blocks]

    return RecurrentGemmaState


def _recurrent_blocks(model: PreTrainedModel) -> list[torch.nn.Module]:
    return [module for module in model.modules() if isinstance(module, _block_class())]


@lru_cache(maxsize=None)
def _block_class() -> type:
    """transformers' RecurrentGemma recurrent block, its forward continuing a state token by token (patched
    once per process: the patch acts only while `_CONTINUING` is set, and follows the class into copies)."""
    block_class = sys.modules["transformers.models.recurrent_gemma.modeling_recurrent_gemma"].RecurrentGemmaRecurrentBlock
    original = block_class.forward

    @functools.wraps(original)
    def forward(block, input_states: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        if not _CONTINUING.get() or input_states.shape[1] == 1:
            return original(block, input_states, position_ids, *args, **kwargs)
        steps = [original(block, input_states[:, i:i + 1], position_ids[:, i:i + 1], *args, **kwargs)[0]
                 for i in range(input_states.shape[1])]  # each (B, 1, H): the decoding path
        return torch.cat(steps, dim=1), None

    block_class.forward = forward
    return block_class


def _bind(model: PreTrainedModel) -> None:
    """Once per model: a forward given a `RecurrentGemmaState` runs with its states on the blocks (hooks on
    the model; a deep copy of the model keeps them, and the mark that says so)."""
    if getattr(model, BOUND, False):
        return
    state_class = _recurrent_gemma_state_class()

    def before(module, args, kwargs) -> None:
        if isinstance(kwargs.get("cache"), state_class):
            kwargs["cache"].enter()

    def after(module, args, kwargs, output) -> None:
        if isinstance(kwargs.get("cache"), state_class):
            kwargs["cache"].leave()

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)
    setattr(model, BOUND, True)


# model_type -> the state it keeps outside transformers' cache layers, made for one sequence
OWN_STATE = {"rwkv": RwkvState, "minimax": lambda model: _minimax_state_class()(),
             "recurrent_gemma": lambda model: _recurrent_gemma_state_class()(model),
             "xlstm": lambda model: _xlstm_state_class()(model)}
# model_type -> the keyword its forward takes that state by, where it is not transformers' cache argument
STATE_ARGUMENTS = {"rwkv": "state"}


def own_state(model: PreTrainedModel):
    """A new state for one sequence, for a model that keeps it outside transformers' cache layers; None for
    the others."""
    make = OWN_STATE.get(model.config.get_text_config().model_type)
    return make(model) if make is not None else None


def keeps_own_state(model: PreTrainedModel) -> bool:
    return model.config.get_text_config().model_type in OWN_STATE
