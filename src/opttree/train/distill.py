"""Draft-model distillation: a small Llama trained to match a frozen target's next-token
distribution, loss = (1 - ce_weight) * KL(target || draft) + ce_weight * CE(next token)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..step.drafters.model import WINDOW_KEY
from .lm import (ModelShape, TrainConfig, autocast, build_llama, eval_windows, n_params, save_final,
                 train_loop)


def kl_target_draft(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(softmax target || softmax draft), in fp32; logits (B, T, V)."""
    t_logp = F.log_softmax(target_logits.float(), dim=-1)
    d_logp = F.log_softmax(draft_logits.float(), dim=-1)
    return (t_logp.exp() * (t_logp - d_logp)).sum(-1).mean()


def load_target(path: Path):
    """The frozen target in fp32 weights (run under bf16 autocast), eval mode, no grads."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    target.eval().requires_grad_(False)
    return target


def load_draft(path: Path, target):
    """A saved draft in fp32 weights to train further; its vocabulary must be the target's."""
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"--init {path}: its vocabulary has {draft.config.vocab_size} tokens, the target's "
                         f"{target.config.vocab_size}")
    return draft.train()


def make_distill_loss(target, ce_weight: float) -> Callable:
    if not 0.0 <= ce_weight <= 1.0:
        raise ValueError(f"ce_weight must be in [0, 1], got {ce_weight}")

    def loss_fn(draft, batch: torch.Tensor):
        x, y = batch[:, :-1], batch[:, 1:]  # (B, T)
        with torch.no_grad():
            t_logits = target(input_ids=x).logits  # (B, T, V)
        d_logits = draft(input_ids=x).logits  # (B, T, V)
        kl = kl_target_draft(t_logits, d_logits)
        ce = F.cross_entropy(d_logits.float().flatten(0, 1), y.flatten())
        loss = (1.0 - ce_weight) * kl + ce_weight * ce
        return loss, {"loss": loss.item(), "kl": kl.item(), "ce": ce.item()}

    return loss_fn


@torch.no_grad()
def evaluate_pair(target, draft, windows: torch.Tensor, bf16: bool = True, batch_size: int = 8) -> dict:
    """Held-out draft perplexity, KL(target || draft), and top-1 agreement
    (fraction of positions where argmax draft == argmax target)."""
    was_training = draft.training
    draft.eval()
    ce_sum, kl_sum, agree, count = 0.0, 0.0, 0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i:i + batch_size]
        x, y = w[:, :-1], w[:, 1:]
        with autocast(bf16):
            t_logits = target(input_ids=x).logits.float()
            d_logits = draft(input_ids=x).logits.float()
        n = y.numel()
        ce_sum += F.cross_entropy(d_logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        kl_sum += kl_target_draft(t_logits, d_logits).item() * n
        agree += (t_logits.argmax(-1) == d_logits.argmax(-1)).sum().item()
        count += n
    draft.train(was_training)
    ce = ce_sum / count
    return {"heldout_loss": ce, "heldout_ppl": math.exp(ce), "heldout_kl": kl_sum / count,
            "top1_agreement": agree / count}


def train_draft(target, tokenizer, train_tokens: np.ndarray, heldout_tokens: np.ndarray, shape: ModelShape,
                cfg: TrainConfig, ce_weight: float = 0.1, log: Callable[[str], None] = print, init: Path | None = None):
    """Distil a draft from ``target`` (a fresh one of ``shape``, or the draft saved in ``init`` trained further);
    saves ``run_dir/final``; returns (draft, metrics)."""
    if len(tokenizer) != target.config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, target vocab is {target.config.vocab_size}")
    torch.manual_seed(cfg.seed)
    if init is None:
        draft = build_llama(shape, tokenizer, max_positions=target.config.max_position_embeddings)
    else:  # its own shape
        draft = load_draft(init, target)
        c = draft.config
        shape = ModelShape(hidden=c.hidden_size, layers=c.num_hidden_layers, heads=c.num_attention_heads,
                           intermediate=c.intermediate_size)
    log(f"draft: {n_params(draft) / 1e6:.2f}M params, {shape}; target {n_params(target) / 1e6:.2f}M")
    windows = eval_windows(heldout_tokens, cfg.seq_len, cfg.eval_windows)
    metrics = train_loop(draft, make_distill_loss(target, ce_weight), train_tokens,
                         lambda m: evaluate_pair(target, m, windows, cfg.bf16), cfg, log)
    metrics = {**metrics, "params": n_params(draft), "shape": asdict(shape), "ce_weight": ce_weight}
    # it drafts best over about half its training windows (docs/BENCHMARKS.md, "The draft over the context it was
    # trained on"): the default `draft_window` (`opttree.step.drafters.model.declared_window`)
    draft.config.update({WINDOW_KEY: max(1, cfg.seq_len // 2)})
    save_final(draft, tokenizer, cfg.run_dir / "final")
    (cfg.run_dir / "final_metrics.json").write_text(json.dumps(metrics, indent=2))
    return draft, metrics
