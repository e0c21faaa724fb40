"""EESD-style self-drafting: the target's own first layers draft (docs/METHODS.md, "Self-drafting
with the target's first layers").

The draft of token t+1 is: the target's first L decoder layers over the tokens up to t, then a trained
exit layer (one decoder layer of the target's own kind, started as a copy of its layer L) and its
norm, then the target's LM head. The first L layers are the target's, with the target's weights and
inputs, so their KV of the committed prefix is the target's own: the drafter reads it from the
target's cache and appends only the root and the tree's nodes, on top of a shallow copy of those
layers (the target's cache itself is never written). The exit layer keeps its own small cache, fed with
the target's layer-L states of the committed tokens, which every verification returns.

Saved as a folder: `early_exit.json` (L, the target it was trained for), `early_exit.safetensors`.
"""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from ...device import model_device, on
from ...parts import read_part, save_part
from ...settings.declared import Declared
from ..cache import cache_argument, new_cache, truncate
from ..verify import Verification, attention_bias, masked_attention_kernels
from .head import DraftLMHead, drafting_temperature
from .model import SlotTree, _slot_keys


def decoder_of(target: PreTrainedModel) -> nn.Module:
    """The target's decoder stack (`.layers`, `.norm`), or a clear refusal."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    layers, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
    if not isinstance(layers, nn.ModuleList) or not isinstance(norm, nn.Module):
        raise ValueError(f"early-exit drafting runs the target's first decoder layers and needs a decoder with "
                         f"`.layers` and `.norm` (Llama-style); {type(target).__name__} has none")
    return decoder


def partial_decoder(decoder: nn.Module, layers: list[nn.Module], norm: nn.Module, types: list[str] | None) -> nn.Module:
    """The target's decoder run over other layers (of these layer types) and norm: the same embedding,
    rotary embedding and masking code, sharing every weight (the target's own modules are untouched)."""
    part = copy.copy(decoder)
    part._modules = dict(decoder._modules)  # its own module table: the swaps below stay in `part`
    part.layers, part.norm = nn.ModuleList(layers), norm
    part.config = copy.copy(decoder.config)
    part.config.num_hidden_layers = len(layers)
    if types is not None:
        part.config.layer_types = types
    return part


class ExitLayer(nn.Module):
    """The trained part: one decoder layer and a norm over the target's layer-L states, for a target of
    n > L layers; started as a copy of the target's layer L and final norm (the target minus its
    layers L+1..n-1)."""

    def __init__(self, target: PreTrainedModel, layers: int):
        super().__init__()
        decoder = decoder_of(target)
        total = len(decoder.layers)
        if not (isinstance(layers, int) and 1 <= layers < total):
            raise ValueError(f"early exit after {layers!r} layers: the target has {total}, "
                             f"so 1 <= layers <= {total - 1}")
        self.exit_after, self.config = layers, decoder.config  # the config: what its layer is a copy of
        self.layer, self.norm = copy.deepcopy(decoder.layers[layers]), copy.deepcopy(decoder.norm)
        for module in self.layer.modules():  # its cache is its own, with one layer: index 0
            if hasattr(module, "layer_idx"):
                module.layer_idx = 0
        self.layer.requires_grad_(True), self.norm.requires_grad_(True)
        self.temperature = 1.0  # divides its logits when drafting: calibrated after training (fit_temperature)
        # not submodules: their weights are the target's and stay out of this module's state_dict
        types = getattr(decoder.config, "layer_types", None)
        self.layer_types = types and types[layers : layers + 1]  # its one layer's kind (its cache's: `new_cache`)
        self.__dict__["lower"] = partial_decoder(decoder, list(decoder.layers[:layers]), nn.Identity(),
                                                 types and types[:layers])
        self.__dict__["upper"] = partial_decoder(decoder, [self.layer], self.norm, self.layer_types)

    def forward(self, states: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None = None,
                cache=None, keys=None) -> torch.Tensor:
        """states: (B, Q, H) the target's layer-L outputs; positions (B, Q); allowed: (Q, cache + Q)
        bool for one sequence with a cache (drafting), None for causal attention (training); `keys`:
        the keys' positions, as `masked_forward` takes them. Returns the normed features (B, Q, H) the
        target's LM head reads."""
        return _run(self.upper, positions, allowed, cache, keys, inputs_embeds=states)

    def save(self, folder: str | Path, target: PreTrainedModel, about: dict | None = None) -> Path:
        meta = {"layers": self.exit_after, "temperature": self.temperature, **(about or {})}
        return save_part(self, folder, "early_exit", target, meta)


def _run(part: nn.Module, positions: torch.Tensor, allowed: torch.Tensor | None, cache, keys=None,
         **inputs) -> torch.Tensor:
    mask = None if allowed is None else attention_bias(part, allowed, positions, keys)
    with masked_attention_kernels(positions.device):
        out = part(position_ids=positions, attention_mask=mask, **{cache_argument(part): cache},
                   use_cache=cache is not None, **inputs)
    return out.last_hidden_state


def load_early_exit(folder: str | Path, target: PreTrainedModel) -> ExitLayer:
    """A saved exit layer, checked against `target` (one trained for another target is refused)."""
    meta, weights = read_part(folder, "early_exit", target, "exit layer", "early-exit")
    layer = ExitLayer(target, meta["layers"])
    layer.load_state_dict(weights)
    layer.temperature = meta.get("temperature", 1.0)
    return layer.to(model_device(target)).eval()


class EarlyExitDrafter(Declared):
    """The Drafter over an ExitLayer. Per step: a shallow copy of the target's cache for the first L
    layers takes the root and the nodes; the exit layer's cache holds the committed positions (fed the
    target's layer-L states) and the step's nodes, which are dropped after it."""

    wants_hidden = True  # the layer-L states of the committed tokens: the prompt's, then each step's

    def __init__(self, exit_layer: ExitLayer, target: PreTrainedModel, vocab: int, sampling: bool = False):
        self.exit, self.vocab = exit_layer, vocab
        self.temperature = drafting_temperature(exit_layer.temperature, sampling)
        self.hidden_layer = exit_layer.exit_after  # transformers' numbering: the output of layer L-1
        self.lm_head = DraftLMHead(target.get_output_embeddings(), vocab)
        self.networks = (exit_layer,)  # the target's layers and LM head are packed with the target
        self.device = model_device(target)
        self.slots = SlotTree(self.device)  # the current step's slots
        self.target_cache: DynamicCache | None = None
        self.start(torch.empty(0, dtype=torch.long))

    def start(self, input_ids: torch.Tensor) -> None:
        self.cache = new_cache(layer_types=self.exit.layer_types)  # the exit layer's
        self.fed = 0  # positions 0..fed-1 are in the exit layer's cache
        self.pending = torch.empty(0, self.exit.norm.weight.shape[-1], device=self.device)  # (P, H) not fed yet

    reads_target_cache = True  # drafts on the target's own cache: the engine shares it (`share_target_cache`)

    def share_target_cache(self, cache: DynamicCache) -> None:
        """The target's cache, read at each root (it holds the committed tokens but the root)."""
        self.target_cache = cache

    def seed_hidden(self, hidden_states: tuple[torch.Tensor, ...]) -> None:
        self.pending = hidden_states[self.hidden_layer].detach().to(self.device)  # (T - 1, H)

    def root(self, committed: torch.Tensor) -> torch.Tensor:
        assert self.target_cache is not None, "the engine shares the target's cache after the prefill"
        truncate(self.cache, self.fed)  # drop the last tree's nodes
        root = committed.shape[0] - 1
        # the first L layers: a shallow copy of the target's cache (appends rebind the copy's tensors only)
        self.lower_cache = DynamicCache()
        self.lower_cache.layers = [copy.copy(layer) for layer in self.target_cache.layers[: self.exit.exit_after]]
        assert self.lower_cache.get_seq_length() == root, "the target's cache holds every committed token but the root"
        positions = torch.tensor([root], device=self.device)
        state = _run(self.exit.lower, positions[None], torch.ones(1, root + 1, dtype=torch.bool, device=self.device),
                     self.lower_cache, input_ids=committed[-1:].to(self.device)[None])[0]  # (1, H)
        states = torch.cat([self.pending.to(state.dtype), state])  # positions fed..root
        assert states.shape[0] == root + 1 - self.fed, "the target's layer-L states of every committed token are needed"
        allowed = torch.ones(states.shape[0], root + 1, dtype=torch.bool, device=self.device)
        allowed[:, self.fed :] = allowed[:, self.fed :].tril()
        positions = torch.arange(self.fed, root + 1, device=self.device)[None]
        features = self.exit(states[None], positions, allowed, self.cache)
        self.fed, self.pending = root + 1, self.pending[:0]
        self.slots.reset()
        return self._log_probs(features[0, -1])

    def expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
        tokens, parent_slots = on(tokens, self.device), on(parent_slots, self.device)
        depths, ancestors = self.slots.add(parent_slots)  # (K,), (K, S+K)
        allowed = torch.cat([torch.ones(tokens.shape[0], self.fed, dtype=torch.bool, device=self.device), ancestors],
                            dim=1)  # (K, fed+S+K): both caches hold the committed tokens, then the slots
        positions = (self.fed - 1 + depths)[None]
        keys = partial(_slot_keys, self.fed, self.slots, allowed.shape[1])  # made if a layer asks
        states = _run(self.exit.lower, positions, allowed, self.lower_cache, keys, input_ids=tokens[None])
        return self._log_probs(self.exit(states, positions, allowed, self.cache, keys)[0])

    def observe(self, result: Verification) -> None:
        """The target's layer-L states of the accepted nodes (the root's went in at `root`)."""
        accepted = result.accepted_hidden(self.hidden_layer)[1:]
        self.pending = torch.cat([self.pending, accepted.to(self.device, self.pending.dtype)])
        self.lower_cache = None  # the target's cache moved on

    def _log_probs(self, features: torch.Tensor) -> torch.Tensor:
        return self.lm_head(features, self.temperature)
