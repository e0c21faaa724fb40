"""Any Hugging Face causal LM as the draft, with its own KV cache.

One forward per tree layer: the nodes of a layer attend to the committed prefix, to their own
ancestors and to themselves (an ancestor-only mask, never a stale sibling).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..cache import compact, new_cache, truncate
from ..verify import masked_forward


class ModelDrafter:
    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.cache = new_cache()
        self.committed_len = 0  # tokens of the committed sequence held in the cache
        self.base = 0  # committed length when the current tree was opened
        self.slot_depths = torch.empty(0, dtype=torch.long)  # (S,)
        self.slot_ancestors = torch.empty(0, 0, dtype=torch.bool)  # (S, S): [i, j] slot j is i or its ancestor

    def start(self, input_ids: torch.Tensor) -> None:
        self.cache = new_cache()
        self.committed_len = 0

    def root(self, committed: torch.Tensor) -> torch.Tensor:
        truncate(self.cache, self.committed_len)  # drop the slots of the previous tree
        new = committed[self.committed_len :]  # (R,) tokens the draft has not seen yet
        assert new.numel() > 0, "the root must be new to the drafter"
        positions = torch.arange(self.committed_len, committed.shape[0])
        logits = self.model(
            input_ids=new[None], position_ids=positions[None], past_key_values=self.cache, use_cache=True
        ).logits[0, -1]  # (V,)
        self.committed_len = self.base = committed.shape[0]
        self.slot_depths = torch.empty(0, dtype=torch.long)
        self.slot_ancestors = torch.empty(0, 0, dtype=torch.bool)
        return torch.log_softmax(logits.float(), dim=-1)

    def expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
        k, s = tokens.shape[0], self.slot_depths.shape[0]
        has_parent = parent_slots >= 0
        depths = torch.where(has_parent, self.slot_depths[parent_slots.clamp(min=0)] + 1, 1) if s else torch.ones_like(tokens)
        ancestors = torch.zeros(k, s + k, dtype=torch.bool)  # (K, S+K)
        if s:
            ancestors[:, :s] = self.slot_ancestors[parent_slots.clamp(min=0)] & has_parent[:, None]
        ancestors[:, s:] = torch.eye(k, dtype=torch.bool)
        allowed = torch.cat([torch.ones(k, self.base, dtype=torch.bool), ancestors], dim=1)  # (K, base+S+K)
        logits = masked_forward(self.model, self.cache, tokens, self.base - 1 + depths, allowed)  # (K, V)

        grown = torch.zeros(s + k, s + k, dtype=torch.bool)
        grown[:s, :s] = self.slot_ancestors
        grown[s:] = ancestors
        self.slot_ancestors = grown
        self.slot_depths = torch.cat([self.slot_depths, depths])
        return torch.log_softmax(logits.float(), dim=-1)

    def accept(self, slots: torch.Tensor) -> None:
        run = slots >= 0  # the drafted nodes of an accepted path form a prefix of it
        kept = slots[: int(run.long().cumprod(0).sum())]
        compact(self.cache, self.base, kept)
        self.committed_len = self.base + kept.shape[0]
