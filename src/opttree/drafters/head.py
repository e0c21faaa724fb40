"""An EAGLE-style feature head: a draft that reads the target (DESIGN.md section 15).

The target's last hidden state at position t-1 ("feature" f[t-1], what its LM head turns into the
distribution of token t) and the embedding of token t go through one linear layer and one decoder
layer to predict f[t]; the target's own (frozen) LM head turns the prediction into the draft's
distribution of token t+1. Committed positions use the target's true features, which every
verification returns (`Verification.hidden_states`); tree nodes below the root use the head's own predicted
features, the parent's prediction feeding the child. EAGLE-1's recipe (feature regression plus the
target's distribution as a soft label) trains it: `opttree train head`.

Saved as a folder: `head.json` (the layer's config, the target it was trained for), `head.safetensors`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel, PreTrainedModel

from ..cache import new_cache, truncate
from ..device import model_device
from ..parts import read_part, save_part
from ..verify import Verification, attention_bias, masked_attention_kernels
from .model import SlotTree, on_target_vocab


def head_config(target: PreTrainedModel) -> LlamaConfig:
    """One Llama decoder layer as wide as the target's features (heads of 64 where the target's differ)."""
    text = target.config.get_text_config()
    hidden = text.hidden_size
    heads = getattr(text, "num_attention_heads", None) or max(hidden // 64, 1)
    if hidden % heads:
        heads = max(hidden // 64, 1)
    return LlamaConfig(hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads,
                       intermediate_size=getattr(text, "intermediate_size", None) or 4 * hidden, vocab_size=1,
                       max_position_embeddings=getattr(text, "max_position_embeddings", 4096) or 4096,
                       rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6), tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


class FeatureHead(nn.Module):
    """(feature f[t-1] (Q, H), embedding of token t (Q, H)) -> predicted feature f[t] (Q, H)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size)
        self.body = LlamaModel(config)  # one decoder layer and a final norm; its 1-row embedding is unused
        self.temperature = 1.0  # divides its logits when drafting: calibrated after training (fit_temperature)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                allowed: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """features, embeds: (B, Q, H); positions (B, Q); allowed: (Q, cache + Q) bool for one sequence
        with a cache (drafting), None for plain causal attention (training). Returns (B, Q, H)."""
        x = self.fc(torch.cat([features, embeds], dim=-1).to(self.fc.weight.dtype))
        mask = None if allowed is None else attention_bias(self.body, allowed)
        with masked_attention_kernels(x.device):
            out = self.body(inputs_embeds=x, position_ids=positions, attention_mask=mask, past_key_values=cache,
                            use_cache=cache is not None)
        return out.last_hidden_state

    def save(self, folder: str | Path, target: PreTrainedModel, about: dict | None = None) -> Path:
        meta = {"config": self.config.to_dict(), "temperature": self.temperature, **(about or {})}
        return save_part(self, folder, "head", target, meta)


def load_head(folder: str | Path, target: PreTrainedModel) -> FeatureHead:
    """A saved head, checked against `target` (a head trained for another target is refused)."""
    meta, weights = read_part(folder, "head", target, "head", "head")
    head = FeatureHead(LlamaConfig.from_dict(meta["config"]))
    head.load_state_dict(weights)
    head.temperature = meta.get("temperature", 1.0)
    device, dtype = model_device(target), target.get_output_embeddings().weight.dtype
    return head.to(device=device, dtype=dtype).eval()


class HeadDrafter:
    """The Drafter over a FeatureHead. The head keeps a KV cache of the committed positions, fed with
    the target's true features; a tree's nodes are appended for the step and dropped after it."""

    wants_hidden = True  # the engine hands over the target's features: the prompt's, then each step's

    def __init__(self, head: FeatureHead, target: PreTrainedModel, vocab: int):
        self.head, self.vocab = head, vocab
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        self.device = model_device(target)
        self.start(torch.empty(0, dtype=torch.long))

    def start(self, input_ids: torch.Tensor) -> None:
        self.cache = new_cache()
        self.fed = 0  # positions 0..fed-1 are in the cache; position t holds (f[t-1], token t), f[-1] = 0
        # (P, H) the target's features not fed yet: f[fed-1..] (f[0..] before the first step)
        self.pending = torch.empty(0, self.head.config.hidden_size, device=self.device)

    def seed_hidden(self, hidden_states: tuple[torch.Tensor, ...]) -> None:
        """The prompt's hidden states ((T - 1, H) per layer), from the target's prefill: the last layer's
        are its features."""
        self.pending = hidden_states[-1].detach().to(self.device)

    def root(self, committed: torch.Tensor) -> torch.Tensor:
        truncate(self.cache, self.fed)  # drop the last tree's nodes (they were fed predicted features)
        committed = committed.to(self.device)
        root = committed.shape[0] - 1
        first = self.fed  # positions first..root get the target's true features; the last predicts f[root]
        features = self.pending  # f[first-1..root-1]
        if first == 0:  # position 0 has no feature before it
            features = torch.cat([features.new_zeros(1, features.shape[1]), features])
        assert features.shape[0] == root + 1 - first, "the target's features of every committed token are needed"
        new = root + 1 - first
        allowed = torch.ones(new, root + 1, dtype=torch.bool, device=self.device)
        allowed[:, first:] = allowed[:, first:].tril()
        predicted = self._run(features, committed[first:], torch.arange(first, root + 1, device=self.device), allowed)
        self.fed, self.pending = root + 1, self.pending[:0]
        self.slot_features = predicted[-1:]  # (1, H): row 0 = the root, row s + 1 = slot s
        self.slots = SlotTree(self.device)
        return self._log_probs(predicted[-1])

    def expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
        tokens, parent_slots = tokens.to(self.device), parent_slots.to(self.device)
        depths, ancestors = self.slots.add(parent_slots)  # (K,), (K, S+K)
        allowed = torch.cat([torch.ones(tokens.shape[0], self.fed, dtype=torch.bool, device=self.device), ancestors],
                            dim=1)  # (K, fed+S+K)
        parent_features = self.slot_features[parent_slots + 1]  # (K, H): row 0 = the root's prediction
        predicted = self._run(parent_features, tokens, self.fed - 1 + depths, allowed)  # (K, H)
        self.slot_features = torch.cat([self.slot_features, predicted])
        return self._log_probs(predicted)

    def observe(self, result: Verification) -> None:
        """The target's features of the tokens this step committed (the root and the accepted nodes)."""
        self.pending = torch.cat([self.pending, result.accepted_hidden().to(self.device, self.pending.dtype)])

    def _run(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             allowed: torch.Tensor) -> torch.Tensor:
        """(Q, H) features, (Q,) tokens, (Q,) positions -> (Q, H) predicted features, appended to the cache."""
        out = self.head(features[None], self.embed(tokens)[None], positions[None], allowed, self.cache)
        return out[0]

    def _log_probs(self, features: torch.Tensor) -> torch.Tensor:
        return drafted_log_probs(self.lm_head, features, self.vocab, self.head.temperature)


def drafted_log_probs(lm_head: nn.Module, features: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    """(..., H) features -> (..., vocab) float32 log-probabilities through the target's LM head, at the
    part's calibrated temperature (any value is lossless: it only shapes the tree)."""
    logits = on_target_vocab(lm_head(features.to(lm_head.weight.dtype)).float(), vocab)
    return torch.log_softmax(logits / temperature if temperature != 1 else logits, dim=-1)
