"""Recurrent models whose state transformers keeps outside its cache layers, verified as chains (`opttree.chains`).

- RWKV's forward takes and returns `state`: five tensors (B, hidden, layers) (the feed-forward's and the
  attention's last input, and the attention's numerator, denominator and running maximum), which every
  layer reads and writes in place.
- MiniMax's forward takes only its own `MiniMaxCache`, whose lightning-attention layers keep their state
  (K^T V per head) in a list beside the cache's layers, which hold the softmax-attention layers' keys.

Both continue their state as decoding does on a forward of several new tokens (RWKV's and MiniMax's
recurrences run token by token once a state is cached). `RwkvState` and `MiniMaxState` are those states
with the calls chain verification makes of a cache: replicate a row (`reorder_cache`, as new tensors),
`save` and `restore`.
"""

from __future__ import annotations

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


# model_type -> the state it keeps outside transformers' cache layers, made for one sequence
OWN_STATE = {"rwkv": RwkvState, "minimax": lambda model: _minimax_state_class()()}
# model_type -> the keyword its forward takes that state by, where it is not transformers' cache argument
STATE_ARGUMENTS = {"rwkv": "state"}


def own_state(model: PreTrainedModel):
    """A new state for one sequence, for a model that keeps it outside transformers' cache layers; None for
    the others."""
    make = OWN_STATE.get(model.config.get_text_config().model_type)
    return make(model) if make is not None else None


def keeps_own_state(model: PreTrainedModel) -> bool:
    return model.config.get_text_config().model_type in OWN_STATE
