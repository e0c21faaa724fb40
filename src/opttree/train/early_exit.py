"""Training an EESD exit layer (`opttree train early-exit`) by self-distillation on text the target writes.

The target's first L layers are frozen (they are the target's); the exit layer and its norm learn to
turn the target's layer-L states into the target's own next-token distribution (loss: cross-entropy
against the target's distribution, a soft label). The layer starts as a copy of the target's layer L and
final norm, so training starts from "the target with its upper layers skipped". Held-out acceptance:
how often the exit's top token equals the target's, on text the target wrote from held-out prompts,
before and after training. Last, a temperature that calibrates the exit's p-hat on those windows is
fitted (as `opttree calibrate` fits the draft model's) and saved with it: the drafter divides its
logits by it, which shapes the tree only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..alignment import fit_draft_temperature
from ..step.drafters.early_exit import ExitLayer
from .lm import TrainConfig, eval_windows, n_params, train_loop


def exit_outputs(exit_layer: ExitLayer, target, batch: torch.Tensor):
    """(B, T) tokens -> (the exit's log-probabilities (B, T, V), the target's (B, T, V))."""
    with torch.no_grad():
        out = target(input_ids=batch, output_hidden_states=True)
        states, log_p = out.hidden_states[exit_layer.exit_after], F.log_softmax(out.logits.float(), dim=-1)
    positions = torch.arange(batch.shape[1], device=batch.device).expand(batch.shape[0], -1)
    features = exit_layer(states, positions)
    return F.log_softmax(target.get_output_embeddings()(features).float(), dim=-1), log_p


def make_exit_loss(target) -> Callable:
    def loss_fn(exit_layer, batch: torch.Tensor):
        log_q, log_p = exit_outputs(exit_layer, target, batch)
        loss = -(log_p.exp() * log_q).sum(-1).mean()  # cross-entropy against the target's distribution
        return loss, {"loss": loss.item()}

    return loss_fn


@torch.no_grad()
def held_out_acceptance(exit_layer: ExitLayer, target, windows: torch.Tensor, batch_size: int = 8) -> dict:
    """Top-1 agreement of the exit and the target at every position of the held-out windows."""
    was_training = exit_layer.training
    exit_layer.eval()
    agree, count = 0, 0
    for i in range(0, len(windows), batch_size):
        log_q, log_p = exit_outputs(exit_layer, target, windows[i : i + batch_size])
        agree += int((log_q.argmax(-1) == log_p.argmax(-1)).sum())
        count += log_p.shape[0] * log_p.shape[1]
    exit_layer.train(was_training)
    return {"heldout_top1": agree / count}


@torch.no_grad()
def calibrated_temperature(exit_layer: ExitLayer, target, windows: torch.Tensor, batch_size: int = 8) -> float:
    """The temperature that calibrates the exit's p-hat for greedy acceptance on the held-out windows
    (`opttree.alignment.fit_draft_temperature`, as for the draft model)."""
    pairs = []
    for i in range(0, len(windows), batch_size):
        log_q, log_p = exit_outputs(exit_layer.eval(), target, windows[i : i + batch_size])
        pairs.append((log_p.flatten(0, 1), log_q.flatten(0, 1)))
    return fit_draft_temperature(pairs)


def train_early_exit(target, layers: int, train_tokens: np.ndarray, heldout_tokens: np.ndarray, cfg: TrainConfig,
                     out: Path, log: Callable = print) -> tuple[ExitLayer, dict]:
    """An exit layer after the target's first `layers` layers, trained on `train_tokens`; saved to `out`."""
    torch.manual_seed(cfg.seed)
    exit_layer = ExitLayer(target, layers)
    windows = eval_windows(heldout_tokens, cfg.seq_len, cfg.eval_windows)
    start = held_out_acceptance(exit_layer, target, windows)["heldout_top1"]
    log(f"early exit after {layers} of {len(target.get_decoder().layers)} layers: exit layer {n_params(exit_layer) / 1e6:.2f}M params, {len(train_tokens) / 1e3:.0f}k training tokens; "
        f"held-out top-1 agreement before training (the target minus its upper layers): {start:.3f}")
    metrics = train_loop(exit_layer, make_exit_loss(target), train_tokens,
                         lambda e: held_out_acceptance(e, target, windows), cfg, log)
    exit_layer.temperature = calibrated_temperature(exit_layer, target, windows)
    metrics = {**metrics, "params": n_params(exit_layer), "layers": layers, "heldout_top1_before": start,
               "temperature": exit_layer.temperature}
    log(f"calibrated drafting temperature: {exit_layer.temperature:.3f}")
    exit_layer.save(out, target, about={"metrics": metrics})
    (Path(out) / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return exit_layer, metrics
