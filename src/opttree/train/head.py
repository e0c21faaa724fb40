"""Training an EAGLE-style feature head (`opttree train head`) by self-distillation on text the target writes.

1. Data: windows of a corpus (the target's own: this Python's stdlib, or `--corpus DIR`) prompt the
   target, which writes continuations (sampled at temperature 0.8); prompts and continuations are the
   training text (cached in RUN_DIR/data).
2. Loss, per window, by a recipe (`RECIPES`):
   - `eagle3` (the default): the head reads a low, a middle and the last layer of the target, fused,
     and is scored by cross-entropy against the target's own distribution only, over three passes
     of the training-time test (pass k scores a node k levels below the root, fed the head's own
     outputs and attending as drafting does; weights 0.8**k).
   - `eagle1`: the head reads the last layer and regresses the target's feature f[t] (smooth-L1)
     plus 0.1 x the cross-entropy, over two passes.
3. Held-out acceptance: how often the head's top token equals the target's, with true features
   (the root's children) and with its own (one and two levels deeper), on text the target wrote from
   held-out prompts. Last, a temperature that calibrates the head's p-hat there is fitted and saved.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..alignment import fit_draft_temperature
from ..step.drafters.head import DraftLMHead, FeatureHead, fused_layers, head_config
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


@dataclass(frozen=True)
class HeadRecipe:
    """How a head is built and trained. `layers`: the target's hidden_states it reads (None = EAGLE-3's
    low, middle and last, `fused_layers`); `passes`: depths of the training-time test; each pass k
    weighs `decay`**k x (`reg_weight` x smooth-L1 to the target's last feature + `cls_weight` x
    cross-entropy against the target's distribution)."""

    layers: tuple[int, ...] | None
    passes: int
    reg_weight: float
    cls_weight: float
    decay: float


RECIPES = {
    "eagle3": HeadRecipe(layers=None, passes=3, reg_weight=0.0, cls_weight=1.0, decay=0.8),
    "eagle1": HeadRecipe(layers=(-1,), passes=2, reg_weight=1.0, cls_weight=0.1, decay=1.0),
}


def head_inputs(head: FeatureHead, target, batch: torch.Tensor):
    """(B, L) tokens -> (the head's input features (B, L, k H), the target's last feature f (B, L, H),
    the target's log-probabilities (B, L, V), token embeddings (B, L, H))."""
    with torch.no_grad():
        hidden = target(input_ids=batch, output_hidden_states=True).hidden_states
        log_p = F.log_softmax(target.get_output_embeddings()(hidden[-1]).float(), dim=-1)
    return head.target_features(hidden), hidden[-1], log_p, target.get_input_embeddings()(batch).detach()


def training_time_mask(length: int, k: int, device=None) -> torch.Tensor:
    """(L, (k + 1) L) bool: what pass k's queries attend to in the training-time test. Pass k at
    position t stands for a tree node k levels below a root at t - k: it sees pass 0's keys at
    positions <= t - k (the committed prefix, fed true features) and pass j's key at t - k + j for
    j = 1..k (its ancestors and itself), just as drafting does."""
    t = torch.arange(length, device=device)
    blocks = [t[None, :] <= t[:, None] - k]  # pass 0 (with k = 0: plain causal)
    blocks += [t[None, :] == t[:, None] - (k - j) for j in range(1, k + 1)]
    return torch.cat(blocks, dim=1)


def unrolled(head: FeatureHead, target, batch: torch.Tensor, passes: int = 2):
    """EAGLE-3's training-time test: [(pass k's outputs (B, L, H))], with the target's last features and
    log-probabilities. Pass 0 reads the target's features (f[t-1], token t) under a causal mask; pass
    k > 0 reads its own pass k-1 output at t-1 and attends as a node k levels deep (`training_time_mask`),
    through a KV cache that keeps every pass. Outputs at t < k have no root and are not scored."""
    from transformers import DynamicCache

    features, last, log_p, embeds = head_inputs(head, target, batch)
    length = batch.shape[1]
    positions = torch.arange(length, device=batch.device).expand(batch.shape[0], -1)
    inputs = torch.cat([features.new_zeros(features.shape[0], 1, features.shape[2]), features[:, :-1]], dim=1)
    cache, outputs = DynamicCache(), []
    for k in range(passes):
        out = head(inputs, embeds, positions, training_time_mask(length, k, batch.device), cache, own=k > 0)
        outputs.append(out)
        inputs = torch.cat([out.new_zeros(out.shape[0], 1, out.shape[2]), out[:, :-1]], dim=1)
    return outputs, last, log_p


def make_head_loss(target, recipe: HeadRecipe) -> Callable:
    lm_head = target.get_output_embeddings()

    def loss_fn(head, batch: torch.Tensor):
        outputs, last, log_p = unrolled(head, target, batch, recipe.passes)
        logs, total, weights = {}, 0.0, 0.0
        for k, out in enumerate(outputs):
            out, f, p = out[:, k:], last[:, k:], log_p[:, k:]  # positions with a root k levels up
            reg = F.smooth_l1_loss(out.float(), f.float())
            cls = -(p.exp() * F.log_softmax(lm_head(out.to(f.dtype)).float(), dim=-1)).sum(-1).mean()
            total = total + recipe.decay**k * (recipe.reg_weight * reg + recipe.cls_weight * cls)
            weights += recipe.decay**k
            logs[f"reg{k}"], logs[f"cls{k}"] = reg.item(), cls.item()
        loss = total / weights
        logs["loss"] = loss.item()
        return loss, logs

    return loss_fn


@torch.no_grad()
def held_out_acceptance(head: FeatureHead, target, windows: torch.Tensor, batch_size: int = 8,
                        passes: int = 3) -> dict:
    """Top-1 agreement of head and target, given the tokens before: with true input features (pass 0,
    the root's children), with the head's own one level deeper (pass 1), and two levels (pass 2)."""
    was_training = head.training
    head.eval()
    lm_head = target.get_output_embeddings()
    drafted = DraftLMHead(lm_head, lm_head.weight.shape[0], head.draft_vocab)  # over its draft vocabulary
    agree, count = [0] * passes, 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size]
        outputs, last, _ = unrolled(head, target, batch, passes)
        choice = lm_head(last).argmax(-1)[:, passes:]  # positions every pass scores (position 0 has no feature)
        for k, out in enumerate(outputs):
            agree[k] += int((drafted(out).argmax(-1)[:, passes:] == choice).sum())
        count += choice.numel()
    head.train(was_training)
    names = ["heldout_top1", "heldout_top1_own_features", "heldout_top1_depth3"]
    return {name: a / count for name, a in zip(names, agree)}


@torch.no_grad()
def calibrated_temperature(head: FeatureHead, target, windows: torch.Tensor, batch_size: int = 8) -> float:
    """The temperature that calibrates the head's p-hat (true input features) for greedy acceptance on the
    held-out windows (`opttree.alignment.fit_draft_temperature`, as for the draft model)."""
    lm_head, pairs = target.get_output_embeddings(), []
    for i in range(0, len(windows), batch_size):
        outputs, last, _ = unrolled(head.eval(), target, windows[i : i + batch_size], passes=1)
        pairs.append((lm_head(last)[:, 1:].flatten(0, 1).float(),
                      lm_head(outputs[0].to(last.dtype))[:, 1:].flatten(0, 1).float()))
    return fit_draft_temperature(pairs)


def frequent_tokens(tokens: np.ndarray, n: int) -> list[int]:
    """EAGLE-3's draft vocabulary: the `n` ids most frequent in `tokens` (the target's text), sorted."""
    counts = np.bincount(tokens)
    return sorted(int(i) for i in np.argsort(-counts, kind="stable")[:n])


def with_draft_vocab(head: FeatureHead, target, train_tokens: np.ndarray, windows: torch.Tensor, n: int) -> dict:
    """Restrict `head` to the `n` ids most frequent in its training text; returns the held-out figures
    with the restriction, and how many of the target's held-out choices it still covers."""
    head.draft_vocab = frequent_tokens(train_tokens, n)
    covered = float(np.isin(windows[:, 1:].numpy(), head.draft_vocab).mean())
    return {"draft_vocab": n, "draft_vocab_coverage": covered,
            **{f"{k}_draft_vocab": v for k, v in held_out_acceptance(head, target, windows).items()}}


def train_head(target, train_tokens: np.ndarray, heldout_tokens: np.ndarray, cfg: TrainConfig, out: Path,
               recipe: HeadRecipe = RECIPES["eagle3"], draft_vocab: int = 0,
               log: Callable = print) -> tuple[FeatureHead, dict]:
    """A fresh head for `target`, trained on `train_tokens` by `recipe` (drafting only the `draft_vocab`
    most frequent ids, 0 = all); saved to `out`; returns (head, metrics)."""
    torch.manual_seed(cfg.seed)
    head = FeatureHead(head_config(target), recipe.layers or fused_layers(target))
    log(f"head: {n_params(head) / 1e6:.2f}M params (1 decoder layer, hidden {head.config.hidden_size}, reads "
        f"layers {list(head.layers)}), {len(train_tokens) / 1e3:.0f}k training tokens, "
        f"{len(heldout_tokens) / 1e3:.0f}k held-out")
    windows = eval_windows(heldout_tokens, cfg.seq_len, cfg.eval_windows)
    metrics = train_loop(head, make_head_loss(target, recipe), train_tokens,
                         lambda h: held_out_acceptance(h, target, windows), cfg, log)
    head.temperature = calibrated_temperature(head, target, windows)
    metrics = {**metrics, "params": n_params(head), "temperature": head.temperature, "recipe": asdict(recipe)}
    log(f"calibrated drafting temperature: {head.temperature:.3f}")
    if draft_vocab:
        metrics |= with_draft_vocab(head, target, train_tokens, windows, draft_vocab)
        log(f"draft vocabulary: the {draft_vocab} most frequent ids cover {metrics['draft_vocab_coverage']:.1%} of the "
            f"held-out text; top-1 agreement with them {metrics['heldout_top1_draft_vocab']:.1%}")
    head.save(out, target, about={"metrics": metrics})
    (Path(out) / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return head, metrics
