"""An EAGLE-style feature head: a draft that reads the target (docs/METHODS.md, "A draft that reads
the target").

The target's hidden states at position t-1 (its "feature" f[t-1]) and the embedding of token t go
through one linear layer and one decoder layer; the target's own (frozen) LM head turns the layer's
output into the draft's distribution of token t+1. The feature is one layer's state or several fused:

- EAGLE-1: the last layer's state alone (what the target's LM head reads); trained to regress f[t].
- EAGLE-3: a low, a middle and the last layer's states, concatenated and fused by a linear layer
  (3H -> H); trained on the target's distributions only, with the training-time test.

Committed positions use the target's true features, which every verification returns
(`Verification.hidden_states`); tree nodes below the root use the head's own output in the feature's
place, the parent's output feeding the child. `opttree train head` trains either recipe.

Saved as a folder: `head.json` (the layer's config, the fused layers, the target it was trained for),
`head.safetensors`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel, PreTrainedModel

from ...device import model_device, on
from ...parallel import whole
from ...parts import read_part, save_part
from ...settings.declared import Declared
from ..cache import cache_argument, new_cache, truncate
from ..draft_forward import head_forward
from ..sampling import as_float32
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


def last_layer(target: PreTrainedModel) -> int:
    """The index of the target's last hidden state in transformers' `hidden_states` (0 = embeddings)."""
    return target.config.get_text_config().num_hidden_layers


def fused_layers(target: PreTrainedModel) -> tuple[int, ...]:
    """EAGLE-3's choice: a low layer (the second), the middle one and the last, as `hidden_states` indices."""
    n = last_layer(target)
    return tuple(sorted({min(2, n), max(n // 2, 1), n}))


class FeatureHead(nn.Module):
    """(feature f[t-1] (Q, H) or the fused layers' states (Q, k H), embedding of token t (Q, H))
    -> the head's output a[t] (Q, H), which the target's LM head reads."""

    def __init__(self, config: LlamaConfig, layers: tuple[int, ...] = (-1,)):
        super().__init__()
        self.config, self.layers = config, tuple(layers)  # the target's hidden_states it reads
        hidden = config.hidden_size
        self.fuse = nn.Linear(len(self.layers) * hidden, hidden) if len(self.layers) > 1 else None
        self.fc = nn.Linear(2 * hidden, hidden)
        self.body = LlamaModel(config)  # one decoder layer and a final norm; its 1-row embedding is unused
        self.temperature = 1.0  # divides its logits when drafting: calibrated after training (fit_temperature)
        self.draft_vocab: list[int] | None = None  # EAGLE-3: the token ids it drafts (None: all)

    def target_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The target's hidden states (one (..., H) per layer) -> the (..., k H) input this head reads."""
        return torch.cat([hidden_states[i] for i in self.layers], dim=-1)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                allowed: torch.Tensor | None = None, cache=None, own: bool = False) -> torch.Tensor:
        """features (B, Q, k H) from `target_features`, or with `own` the head's outputs (B, Q, H);
        embeds (B, Q, H); positions (B, Q); allowed: (Q, cache + Q) bool, None for plain causal
        attention. Returns (B, Q, H)."""
        features = features.to(self.fc.weight.dtype)
        if self.fuse is not None and not own:
            features = self.fuse(features)
        x = self.fc(torch.cat([features, embeds.to(features.dtype)], dim=-1))
        mask = None if allowed is None else attention_bias(self.body, allowed, positions)
        with masked_attention_kernels(x.device):
            out = self.body(inputs_embeds=x, position_ids=positions, attention_mask=mask,
                            **{cache_argument(self.body): cache}, use_cache=cache is not None)
        return out.last_hidden_state

    def save(self, folder: str | Path, target: PreTrainedModel, about: dict | None = None) -> Path:
        meta = {"config": self.config.to_dict(), "layers": list(self.layers), "temperature": self.temperature,
                "draft_vocab": self.draft_vocab, **(about or {})}
        return save_part(self, folder, "head", target, meta)


def load_head(folder: str | Path, target: PreTrainedModel) -> FeatureHead:
    """A saved head, checked against `target` (a head trained for another target is refused)."""
    meta, weights = read_part(folder, "head", target, "head", "head")
    layers = tuple(meta.get("layers", [-1]))
    if any(not -last_layer(target) - 1 <= i <= last_layer(target) for i in layers):
        raise ValueError(f"the head in {folder} reads layers {list(layers)}, past the target's "
                         f"{last_layer(target)} (hidden_states 0..{last_layer(target)})")
    head = FeatureHead(LlamaConfig.from_dict(meta["config"]), layers)
    head.load_state_dict(weights)
    head.temperature = meta.get("temperature", 1.0)
    head.draft_vocab = meta.get("draft_vocab")
    rows = target.get_output_embeddings().weight.shape[0]
    if head.draft_vocab is not None and not 0 <= min(head.draft_vocab) <= max(head.draft_vocab) < rows:
        raise ValueError(f"the head in {folder} drafts token ids outside the target's LM head (0..{rows - 1})")
    device, dtype = model_device(target), target.get_output_embeddings().weight.dtype
    return head.to(device=device, dtype=dtype).eval()


class HeadDrafter(Declared):
    """The Drafter over a FeatureHead. The head keeps a KV cache of the committed positions, fed with
    the target's true features; a tree's nodes are appended for the step and dropped after it."""

    wants_hidden = True  # the engine hands over the target's features: the prompt's, then each step's
    extends_chains = True  # `extend`: a chain's next node, under causal attention

    def __init__(self, head: FeatureHead, target: PreTrainedModel, vocab: int, sampling: bool = False):
        self.head, self.vocab = head, vocab
        self.temperature = drafting_temperature(head.temperature, sampling)
        self.embed = target.get_input_embeddings()
        self.lm_head = DraftLMHead(target.get_output_embeddings(), vocab, head.draft_vocab)
        self.networks = (head, *self.lm_head.networks)  # the target's own LM head is packed with the target
        self.device = model_device(target)
        self.slots = SlotTree(self.device)  # the current step's slots
        self.forward = head_forward(head) or head  # fewer ops than the head's own forward where it applies
        self.start(torch.empty(0, dtype=torch.long))

    def start(self, input_ids: torch.Tensor) -> None:
        self.cache = new_cache()
        self.fed = 0  # positions 0..fed-1 are in the cache; position t holds (f[t-1], token t), f[-1] = 0
        # (P, k H) the target's features not fed yet: f[fed-1..] (f[0..] before the first step)
        width = len(self.head.layers) * self.head.config.hidden_size
        self.pending = torch.empty(0, width, device=self.device)

    def seed_hidden(self, hidden_states: tuple[torch.Tensor, ...]) -> None:
        """The prompt's hidden states ((T - 1, H) per layer), from the target's prefill."""
        self.pending = self.head.target_features(hidden_states).detach().to(self.device)

    def root(self, committed: torch.Tensor) -> torch.Tensor:
        truncate(self.cache, self.fed)  # drop the last tree's nodes (they were fed predicted features)
        committed = on(committed, self.device)
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
        self.slots.reset()
        return self._log_probs(predicted[-1])

    def expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
        tokens, parent_slots = on(tokens, self.device), on(parent_slots, self.device)
        depths, ancestors = self.slots.add(parent_slots)  # (K,), (K, S+K)
        allowed = torch.cat([torch.ones(tokens.shape[0], self.fed, dtype=torch.bool, device=self.device), ancestors],
                            dim=1)  # (K, fed+S+K)
        parent_features = self.slot_features[parent_slots + 1]  # (K, H): row 0 = the root's prediction
        predicted = self._run(parent_features, tokens, self.fed - 1 + depths, allowed, own=True)  # (K, H)
        self.slot_features = torch.cat([self.slot_features, predicted])
        return self._log_probs(predicted)

    def extend(self, token: torch.Tensor) -> torch.Tensor:
        """`expand` of one node (1,) whose parent is the last slot (the root when none), every slot so far being its
        ancestor (a chain): the next token after the cache, no tree mask. Returns (1, V)."""
        token = on(token, self.device)
        depths = self.slots.add_child_of_last()  # (1,)
        predicted = self._run(self.slot_features[-1:], token, self.fed - 1 + depths, None, own=True)  # (1, H)
        self.slot_features = torch.cat([self.slot_features, predicted])
        return self._log_probs(predicted)

    def observe(self, result: Verification) -> None:
        """The target's features of the tokens this step committed (the root and the accepted nodes)."""
        accepted = torch.cat([result.accepted_hidden(i) for i in self.head.layers], dim=-1)  # (A + 1, k H)
        self.pending = torch.cat([self.pending, accepted.to(self.device, self.pending.dtype)])

    def _run(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             allowed: torch.Tensor | None, own: bool = False) -> torch.Tensor:
        """(Q, k H) the target's features (or with `own` (Q, H) the head's outputs), (Q,) tokens, (Q,)
        positions, (Q, cached + Q) `allowed` (None: causal) -> (Q, H) the head's outputs, appended to its cache.
        Through `head_forward` where it applies (on a CPU), else the head's own forward."""
        return self.forward(features[None], self.embed(tokens)[None], positions[None], allowed, self.cache, own)[0]

    def _log_probs(self, features: torch.Tensor) -> torch.Tensor:
        return self.lm_head(features, self.temperature)


def drafting_temperature(calibrated: float, sampling: bool) -> float:
    """The temperature a part that reads the target (head, exit layer) drafts at. Its calibrated one makes
    its p-hat the chance that its top token is the target's (greedy acceptance). When sampling, a child is
    accepted as the target's warped distribution allows (min(1, p/q), or p(x) for a top-ranked child), so it
    drafts from its own distribution, which its training matched to the target's (temperature 1), warped
    like the target's. Measured on the shipped head (bf16, 8 HumanEval prompts, budget 8): at temperature 1,
    mean accepted length 1.83 -> 2.20 and 94 -> 152 tokens/s; at 0.7, 2.79 -> 2.75 and 121 -> 154."""
    return 1.0 if sampling else calibrated


class DraftLMHead:
    """The target's LM head as a part that reads the target drafts with: (..., H) features -> (..., vocab)
    float32 log-probabilities at the part's calibrated temperature (any value is lossless: it only shapes
    the tree). With `rows` (EAGLE-3's draft vocabulary: the ids the target writes most) only those rows
    are computed, and every other id gets probability 0 (never drafted, so still lossless)."""

    def __init__(self, lm_head: nn.Module, vocab: int, rows: list[int] | None = None):
        self.lm_head, self.vocab = lm_head, vocab
        self.rows = None if rows is None else torch.tensor([r for r in rows if r < vocab], device=lm_head.weight.device)
        self.networks: tuple = ()
        if self.rows is not None:  # (N, H) and (N,): the rows kept, sliced once, as a layer of their own
            weight = whole(lm_head.weight.detach())[self.rows]
            self.kept = nn.Linear(weight.shape[1], weight.shape[0], bias=lm_head.bias is not None,
                                  device=weight.device, dtype=weight.dtype).requires_grad_(False)
            self.kept.weight.copy_(weight)
            if lm_head.bias is not None:
                self.kept.bias.copy_(whole(lm_head.bias.detach())[self.rows])
            self.networks = (self.kept,)

    def __call__(self, features: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        dtype = self.lm_head.weight.dtype
        features = features if features.dtype == dtype else features.to(dtype)
        if self.rows is None:
            logits = on_target_vocab(as_float32(self.lm_head(features)), self.vocab)
        else:
            logits = torch.full((*features.shape[:-1], self.vocab), float("-inf"), device=features.device)
            logits[..., self.rows] = as_float32(self.kept(features))
        return torch.log_softmax(logits / temperature if temperature != 1 else logits, dim=-1)
