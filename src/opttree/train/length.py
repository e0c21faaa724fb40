"""Training AdaEAGLE's draft length predictor (`opttree train length-predictor`).

1. Log: real speculative runs at a fixed depth D (`depth_control="fixed"`: no delta stop) over
   prompts taken from a corpus; each step records the target's last hidden state, the root token and
   how many drafted tokens the target accepted (steps whose depth max_new_tokens capped are left out).
2. Fit: a small MLP (`opttree.step.length.LengthPredictor`), cross-entropy over the accepted length 0..D;
   the runs of a sixth of the training prompts are kept aside to pick the epoch (early stopping).
3. Held-out: the same logging on prompts from the held-out split; accuracy, within-one accuracy and the
   mean absolute error of the expected length, beside a constant predictor (the training mean / mode).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..settings.declared import Declared
from ..step.length import LengthPredictor


class StepLog(Declared):
    """A depth control that drafts as `fixed` does and records each step (`stream(..., depth=...)`): the
    target's feature and the root, then the accepted count. A step whose depth max_new_tokens capped
    (the last few of a run) is marked, to be left out."""

    wants_hidden = True

    def __init__(self, max_new_tokens: int, max_depth: int):
        self.remaining, self.max_depth = max_new_tokens, max_depth
        self.steps: list[tuple[torch.Tensor | None, int, bool]] = []  # (feature (H,), root, uncapped)
        self.accepted: list[int] = []

    def limit(self, root: torch.Tensor, feature: torch.Tensor | None) -> None:
        feature = None if feature is None else feature.detach().float().cpu()
        self.steps.append((feature, int(root), self.remaining - 1 >= self.max_depth))
        return None

    def observe(self, accepted: int, depth: int, draft_s: float, verify_s: float) -> None:
        self.accepted.append(accepted)
        self.remaining -= accepted + 1


def logged_steps(target, draft, prompts: list[torch.Tensor], options: dict, desc: str) -> dict:
    """Run every prompt at fixed depth options["max_depth"]; returns {"feature" (N, H), "root" (N,),
    "accepted" (N,), "prompt" (N,)} over the steps max_new_tokens did not cap."""
    from tqdm import tqdm

    from ..speculator import stream

    hidden = target.config.get_text_config().hidden_size
    rows: dict[str, list] = {"feature": [], "root": [], "accepted": [], "prompt": []}
    for i, prompt in enumerate(tqdm(prompts, desc=desc, unit="prompt", dynamic_ncols=True)):
        log = StepLog(options["max_new_tokens"], options["max_depth"])
        for _ in stream(target, prompt, draft, depth=log, depth_control="fixed", **options):
            pass
        for (feature, root, uncapped), accepted in zip(log.steps, log.accepted):
            if uncapped:
                rows["feature"].append(torch.zeros(hidden) if feature is None else feature)
                rows["root"].append(root), rows["accepted"].append(accepted), rows["prompt"].append(i)
    return {"feature": torch.stack(rows["feature"]), **{k: torch.tensor(rows[k]) for k in ("root", "accepted", "prompt")}}


def inputs(target, logged: dict) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return logged["feature"], target.get_input_embeddings()(logged["root"]).float()


@torch.no_grad()
def evaluate(predictor: LengthPredictor, target, logged: dict, train_accepted: torch.Tensor) -> dict:
    feature, embed = inputs(target, logged)
    logits = predictor(feature, embed)
    truth = logged["accepted"]
    expected = (torch.softmax(logits, -1) * torch.arange(logits.shape[-1])).sum(-1)
    guess = logits.argmax(-1)
    mode, mean = int(train_accepted.mode().values), float(train_accepted.float().mean())
    return {"steps": int(truth.numel()), "accuracy": float((guess == truth).float().mean()),
            "within_one": float(((guess - truth).abs() <= 1).float().mean()),
            "mae_expected": float((expected - truth).abs().mean()),
            "constant_accuracy": float((truth == mode).float().mean()),
            "constant_mae": float((truth.float() - mean).abs().mean())}


def fit_length_predictor(target, train: dict, heldout: dict, max_depth: int, epochs: int = 60, lr: float = 2e-3,
                         seed: int = 0, log: Callable = print) -> tuple[LengthPredictor, dict]:
    """Fit on `train`'s rows; the runs of its last sixth of prompts pick the epoch (early stopping on their
    loss); `heldout` (other prompts, never seen in fitting) measures the result."""
    torch.manual_seed(seed)
    predictor = LengthPredictor(train["feature"].shape[1], max_depth)
    feature, embed = inputs(target, train)
    labels = train["accepted"]
    checking = train["prompt"] >= int(train["prompt"].max()) * 5 // 6 + 1  # (N,) rows of the checking prompts
    fit_rows, check_rows = (~checking).nonzero()[:, 0], checking.nonzero()[:, 0]
    optimizer = torch.optim.AdamW(predictor.parameters(), lr=lr, weight_decay=0.01)
    best = (float("inf"), 0, None)  # (checking loss, epoch, weights)
    for epoch in range(1, epochs + 1):
        predictor.train()
        for batch in fit_rows[torch.randperm(fit_rows.numel())].split(256):
            loss = F.cross_entropy(predictor(feature[batch], embed[batch]), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            check = F.cross_entropy(predictor(feature[check_rows], embed[check_rows]), labels[check_rows]).item()
        if check < best[0]:
            best = (check, epoch, {k: v.clone() for k, v in predictor.state_dict().items()})
        if epoch % 20 == 0 or epoch == epochs:
            log(f"epoch {epoch}: fit loss {loss.item():.3f}, checking loss {check:.3f} (best {best[0]:.3f} at "
                f"epoch {best[1]})")
    predictor.load_state_dict(best[2])
    scores = {**evaluate(predictor, target, heldout, labels[fit_rows]), "epoch": best[1]}
    log(f"held-out: accuracy {scores['accuracy']:.3f} (constant {scores['constant_accuracy']:.3f}), within one "
        f"{scores['within_one']:.3f}, MAE {scores['mae_expected']:.2f} (constant {scores['constant_mae']:.2f})")
    return predictor.eval(), scores


def save_predictor(predictor: LengthPredictor, target, out: Path, about: dict) -> None:
    predictor.save(out, target, about=about)
    (Path(out) / "metrics.json").write_text(json.dumps(about["metrics"], indent=2) + "\n")
