"""Training an EAGLE-style feature head (`opttree train head`) by self-distillation on text the target writes.

1. Data: windows of a corpus (the target's own: this Python's stdlib, or `--corpus DIR`) prompt the
   target, which writes continuations (sampled at temperature 0.8); prompts and continuations are the
   training text (cached in RUN_DIR/data).
2. Loss, per window (EAGLE-1's, unrolled once more as a cheap stand-in for EAGLE-3's training-time
   test): the head predicts the target's feature f[t] from (f[t-1], token t); loss = smooth-L1 to f[t]
   + `cls_weight` x cross-entropy against the target's own distribution lm_head(f[t]). A second pass
   feeds the head its own predictions instead of f[t-1], as drafting below the root does.
3. Held-out acceptance: how often the head's top token equals the target's, with true features
   (the root's children) and with its own (one level deeper), on text the target wrote from held-out
   prompts. Last, a temperature that calibrates the head's p-hat there is fitted and saved with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..alignment import fit_draft_temperature
from ..drafters.head import FeatureHead, head_config
from .lm import TrainConfig, eval_windows, n_params, train_loop


@torch.inference_mode()
def written_text(target, corpus: np.ndarray, texts: int, eos: int, prompt_len: int = 64, new_tokens: int = 192,
                 batch: int = 16, temperature: float = 0.8, seed: int = 0, log: Callable = print) -> np.ndarray:
    """`texts` corpus windows of `prompt_len` tokens, each continued by the target: one flat array of
    token ids, every text ending with `eos`."""
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(corpus) - prompt_len, texts)
    device = target.get_output_embeddings().weight.device
    torch.manual_seed(seed)
    parts = []
    for i in tqdm(range(0, texts, batch), desc="target writes", unit="batch", dynamic_ncols=True):
        prompts = torch.from_numpy(np.stack([corpus[s : s + prompt_len] for s in starts[i : i + batch]]).astype(np.int64))
        out = target.generate(prompts.to(device), attention_mask=torch.ones_like(prompts).to(device), do_sample=True,
                              temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                              eos_token_id=eos, pad_token_id=eos)
        for row in out.cpu().numpy():
            ends = np.nonzero(row[prompt_len:] == eos)[0]
            parts.append(row[: prompt_len + ends[0]] if len(ends) else row)
            parts.append(np.array([eos]))
    return np.concatenate(parts).astype(np.int64)


def head_inputs(target, batch: torch.Tensor):
    """(B, L) tokens -> (features f (B, L, H), the target's log-probabilities (B, L, V), token embeddings)."""
    with torch.no_grad():
        features = target(input_ids=batch, output_hidden_states=True).hidden_states[-1]
        log_p = F.log_softmax(target.get_output_embeddings()(features).float(), dim=-1)
    return features, log_p, target.get_input_embeddings()(batch).detach()


def unrolled(head: FeatureHead, target, batch: torch.Tensor, passes: int = 2):
    """[(pass k's predicted features (B, L, H))], with the target's features and log-probabilities.
    Pass 0 reads (f[t-1], token t); pass k > 0 reads its own pass k-1 prediction of f[t-1]."""
    features, log_p, embeds = head_inputs(target, batch)
    positions = torch.arange(batch.shape[1], device=batch.device).expand(batch.shape[0], -1)
    zero = features.new_zeros(features.shape[0], 1, features.shape[2])
    inputs, predictions = torch.cat([zero, features[:, :-1]], dim=1), []
    for _ in range(passes):
        predicted = head(inputs, embeds, positions)
        predictions.append(predicted)
        inputs = torch.cat([zero.to(predicted.dtype), predicted[:, :-1]], dim=1)
    return predictions, features, log_p


def make_head_loss(target, cls_weight: float = 0.1, passes: int = 2) -> Callable:
    lm_head = target.get_output_embeddings()

    def loss_fn(head, batch: torch.Tensor):
        predictions, features, log_p = unrolled(head, target, batch, passes)
        logs, total = {}, 0.0
        for k, predicted in enumerate(predictions):
            reg = F.smooth_l1_loss(predicted.float(), features.float())
            cls = -(log_p.exp() * F.log_softmax(lm_head(predicted).float(), dim=-1)).sum(-1).mean()
            total = total + reg + cls_weight * cls
            logs[f"reg{k}"], logs[f"cls{k}"] = reg.item(), cls.item()
        loss = total / passes
        logs["loss"] = loss.item()
        return loss, logs

    return loss_fn


@torch.no_grad()
def held_out_acceptance(head: FeatureHead, target, windows: torch.Tensor, batch_size: int = 8) -> dict:
    """Top-1 agreement of head and target: with true input features (pass 0, the root's children)
    and with the head's own (pass 1, one level deeper)."""
    was_training = head.training
    head.eval()
    lm_head = target.get_output_embeddings()
    agree, count = [0, 0], 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size]
        predictions, features, _ = unrolled(head, target, batch)
        choice = lm_head(features).argmax(-1)[:, 1:]  # position 0 has no feature before it
        for k, predicted in enumerate(predictions):
            agree[k] += int((lm_head(predicted.to(features.dtype)).argmax(-1)[:, 1:] == choice).sum())
        count += choice.numel()
    head.train(was_training)
    return {"heldout_top1": agree[0] / count, "heldout_top1_own_features": agree[1] / count}


@torch.no_grad()
def calibrated_temperature(head: FeatureHead, target, windows: torch.Tensor, batch_size: int = 8) -> float:
    """The temperature that calibrates the head's p-hat (true input features) for greedy acceptance on the
    held-out windows (`opttree.alignment.fit_draft_temperature`, as for the draft model)."""
    lm_head, pairs = target.get_output_embeddings(), []
    for i in range(0, len(windows), batch_size):
        predictions, features, _ = unrolled(head.eval(), target, windows[i : i + batch_size], passes=1)
        pairs.append((lm_head(features)[:, 1:].flatten(0, 1).float(),
                      lm_head(predictions[0].to(features.dtype))[:, 1:].flatten(0, 1).float()))
    return fit_draft_temperature(pairs)


def train_head(target, train_tokens: np.ndarray, heldout_tokens: np.ndarray, cfg: TrainConfig, out: Path,
               cls_weight: float = 0.1, log: Callable = print) -> tuple[FeatureHead, dict]:
    """A fresh head for `target`, trained on `train_tokens`; saved to `out`; returns (head, metrics)."""
    torch.manual_seed(cfg.seed)
    head = FeatureHead(head_config(target))
    log(f"head: {n_params(head) / 1e6:.2f}M params (1 decoder layer, hidden {head.config.hidden_size}), "
        f"{len(train_tokens) / 1e3:.0f}k training tokens, {len(heldout_tokens) / 1e3:.0f}k held-out")
    windows = eval_windows(heldout_tokens, cfg.seq_len, cfg.eval_windows)
    metrics = train_loop(head, make_head_loss(target, cls_weight), train_tokens,
                         lambda h: held_out_acceptance(h, target, windows), cfg, log)
    head.temperature = calibrated_temperature(head, target, windows)
    metrics = {**metrics, "params": n_params(head), "temperature": head.temperature}
    log(f"calibrated drafting temperature: {head.temperature:.3f}")
    head.save(out, target, about={"metrics": metrics})
    (Path(out) / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return head, metrics
