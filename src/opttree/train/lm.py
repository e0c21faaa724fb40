"""Llama causal-LM pretraining from scratch, and the training loop shared with distillation.

The loop is time-budgeted (``minutes``) and/or step-budgeted (``steps``): the cosine schedule runs
over ``progress = max(step / steps, elapsed / budget)``, so a run stops on time however fast the
(shared) machine happens to be. Checkpoints (model, optimizer, step, elapsed time, RNG states) are
written atomically to ``run_dir/ckpt.pt`` every ``ckpt_minutes``; ``resume=True`` continues from it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    intermediate: int

    @classmethod
    def parse(cls, text: str) -> "ModelShape":
        """``"512,8,8,1376"`` -> hidden 512, 8 layers, 8 heads, intermediate 1376."""
        parts = text.split(",")
        if len(parts) != 4:
            raise ValueError(f"shape must be 'hidden,layers,heads,intermediate', got {text!r}")
        return cls(*(int(p) for p in parts))


TARGET_SHAPE = ModelShape(hidden=512, layers=8, heads=8, intermediate=1376)
DRAFT_SHAPE = ModelShape(hidden=256, layers=1, heads=4, intermediate=688)


def build_llama(shape: ModelShape, tokenizer, max_positions: int = 2048):
    """A freshly initialised LlamaForCausalLM with tied embeddings, sized for ``tokenizer``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape.hidden % shape.heads:
        raise ValueError(f"hidden {shape.hidden} is not divisible by heads {shape.heads}")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def n_params(model) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


@dataclass
class TrainConfig:
    run_dir: Path
    seq_len: int = 512
    batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    steps: int | None = None
    minutes: float | None = None
    eval_every: int = 250
    eval_windows: int = 64
    ckpt_minutes: float = 5.0
    seed: int = 0
    bf16: bool = True
    resume: bool = False
    stop_after: int | None = None  # end this invocation after this many steps (checkpointed; resume later)

    def __post_init__(self):
        self.run_dir = Path(self.run_dir)
        if self.steps is None and self.minutes is None:
            raise ValueError("give a budget: steps and/or minutes")


def lr_at(step: int, progress: float, cfg: TrainConfig) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from lr to lr*min_lr_ratio over progress."""
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def autocast(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


class WindowSampler:
    """Random fixed-length windows ``(B, T+1)`` from a flat token array, from its own seeded RNG."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        if len(tokens) < seq_len + 2:
            raise ValueError(f"corpus has {len(tokens)} tokens, fewer than seq_len+2={seq_len + 2}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len, self.batch_size = seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def sample(self) -> torch.Tensor:
        high = len(self.tokens) - self.seq_len - 1
        starts = torch.randint(0, high, (self.batch_size,), generator=self.gen)
        offsets = torch.arange(self.seq_len + 1)
        return self.tokens[starts[:, None] + offsets[None, :]]  # (B, T+1)


def eval_windows(tokens: np.ndarray, seq_len: int, n: int) -> torch.Tensor:
    """``n`` evenly spaced, non-random windows ``(n, T+1)`` (fewer if the text is short)."""
    t = torch.from_numpy(tokens.astype(np.int64))
    high = len(t) - seq_len - 1
    if high <= 0:
        raise ValueError(f"held-out text has {len(t)} tokens, fewer than seq_len+2={seq_len + 2}")
    n = max(1, min(n, high // seq_len + 1))
    starts = torch.linspace(0, high, n).long()
    return t[starts[:, None] + torch.arange(seq_len + 1)[None, :]]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in fp32; logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def lm_loss(model, batch: torch.Tensor) -> tuple[torch.Tensor, dict]:
    x, y = batch[:, :-1], batch[:, 1:]  # (B, T)
    loss = next_token_loss(model(input_ids=x).logits, y)
    return loss, {"loss": loss.item()}


@torch.no_grad()
def evaluate_lm(model, windows: torch.Tensor, bf16: bool = True, batch_size: int = 8) -> dict:
    """Held-out mean next-token loss and perplexity over ``windows`` (n, T+1)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        w = windows[i:i + batch_size]
        with autocast(bf16):
            logits = model(input_ids=w[:, :-1]).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    model.train(was_training)
    loss = total / count
    return {"heldout_loss": loss, "heldout_ppl": math.exp(loss)}


def _rng_state(sampler: WindowSampler) -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "sampler": sampler.gen.get_state()}


def _set_rng_state(state: dict, sampler: WindowSampler) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    sampler.gen.set_state(state["sampler"])


def save_checkpoint(path: Path, model, optimizer, step: int, elapsed: float, sampler: WindowSampler) -> None:
    tmp = Path(str(path) + ".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "elapsed": elapsed, "rng": _rng_state(sampler), "config": model.config.to_dict()}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model, optimizer, sampler: WindowSampler) -> tuple[int, float]:
    """Restores model, optimizer and RNG in place; returns (step, elapsed seconds)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    _set_rng_state(ckpt["rng"], sampler)
    return ckpt["step"], ckpt["elapsed"]


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def save_final(model, tokenizer, out_dir: Path) -> None:
    """bf16 safetensors + tokenizer, loadable with ``from_pretrained(out_dir)``."""
    import copy

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shipped = copy.deepcopy(model).to(torch.bfloat16)
    shipped.config.dtype = torch.bfloat16
    shipped.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))


def train_loop(model, loss_fn: Callable, train_tokens: np.ndarray, evaluate: Callable[[object], dict],
               cfg: TrainConfig, log: Callable[[str], None] = print) -> dict:
    """Train ``model`` in place with ``loss_fn(model, batch) -> (loss, logs)``; returns the last metrics.

    ``evaluate(model) -> dict`` runs every ``eval_every`` steps and at the end. Metrics are appended
    to ``run_dir/log.jsonl``.
    """
    from tqdm import tqdm

    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)
    sampler = WindowSampler(train_tokens, cfg.seq_len, cfg.batch_size, cfg.seed)
    optimizer = make_optimizer(model, cfg)
    ckpt_path = cfg.run_dir / "ckpt.pt"
    step, elapsed = 0, 0.0
    if cfg.resume and ckpt_path.exists():
        step, elapsed = load_checkpoint(ckpt_path, model, optimizer, sampler)
        log(f"resumed from {ckpt_path} at step {step}, {elapsed / 60:.1f} min elapsed")
    first_step = step
    budget_s = cfg.minutes * 60 if cfg.minutes is not None else None

    def progress() -> float:
        p = 0.0
        if cfg.steps is not None:
            p = max(p, step / cfg.steps)
        if budget_s is not None:
            p = max(p, elapsed / budget_s)
        return p

    def record(metrics: dict) -> None:
        with open(cfg.run_dir / "log.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")

    model.train()
    start = time.perf_counter() - elapsed
    last_ckpt = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, mininterval=10 if cfg.minutes else 0.5, dynamic_ncols=True)
    metrics: dict = {}
    tokens_per_step = cfg.batch_size * cfg.seq_len
    while progress() < 1.0:
        lr = lr_at(step, progress(), cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sampler.sample()
        with autocast(cfg.bf16):
            loss, logs = loss_fn(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        optimizer.step()
        step += 1
        elapsed = time.perf_counter() - start
        bar.update(1)
        bar.set_postfix(loss=f"{logs['loss']:.3f}", lr=f"{lr:.2e}", pct=f"{100 * progress():.0f}",
                        refresh=False)
        done = progress() >= 1.0
        paused = not done and cfg.stop_after is not None and step - first_step >= cfg.stop_after
        if step % cfg.eval_every == 0 or done:
            metrics = {"step": step, "elapsed_min": elapsed / 60, "lr": lr, "grad_norm": grad_norm,
                       "tokens_seen": step * tokens_per_step,
                       "tok_per_s": step * tokens_per_step / max(elapsed, 1e-9), **logs, **evaluate(model)}
            record(metrics)
            bar.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()))
            elapsed = time.perf_counter() - start
        if (time.perf_counter() - last_ckpt) > cfg.ckpt_minutes * 60 or done or paused:
            save_checkpoint(ckpt_path, model, optimizer, step, elapsed, sampler)
            last_ckpt = time.perf_counter()
        if paused:
            break
    bar.close()
    if not metrics:  # resumed a finished run: nothing trained, still report
        metrics = {"step": step, "elapsed_min": elapsed / 60, **evaluate(model)}
    model.eval()
    return metrics


def train_lm(tokenizer, train_tokens: np.ndarray, heldout_tokens: np.ndarray, shape: ModelShape,
             cfg: TrainConfig, log: Callable[[str], None] = print):
    """Pretrain a fresh Llama on ``train_tokens``; saves ``run_dir/final``; returns (model, metrics)."""
    torch.manual_seed(cfg.seed)
    model = build_llama(shape, tokenizer)
    log(f"target: {n_params(model) / 1e6:.2f}M params, {shape}, "
        f"{len(train_tokens) / 1e6:.2f}M train tokens, {len(heldout_tokens) / 1e6:.2f}M held-out tokens")
    windows = eval_windows(heldout_tokens, cfg.seq_len, cfg.eval_windows)
    metrics = train_loop(model, lm_loss, train_tokens, lambda m: evaluate_lm(m, windows, cfg.bf16), cfg, log)
    metrics = {**metrics, "params": n_params(model), "shape": asdict(shape)}
    save_final(model, tokenizer, cfg.run_dir / "final")
    (cfg.run_dir / "final_metrics.json").write_text(json.dumps(metrics, indent=2))
    return model, metrics
