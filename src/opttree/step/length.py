"""AdaEAGLE's draft length predictor as a depth control (`depth_control="predictor"`; docs/METHODS.md, "Depth
control").

Before a step drafts, a small MLP reads the target's last hidden state (at the token before the root)
and the root's embedding, and returns a distribution over how many drafted tokens the step will
accept, 0..D. The control turns it into P(at least k accepted) and drafts the depth that maximises the
expected tokens per unit of time (`opttree.step.depth.PredictorDepth`). Trained offline on accepted lengths
logged from real runs at a fixed depth D (`opttree train length-predictor`).

Saved as a folder: `length.json` (shape, the target it was trained for, how the runs were made),
`length.safetensors`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..device import model_device
from ..parts import read_part, save_part


class LengthPredictor(nn.Module):
    """(feature (B, H), root embedding (B, H)) -> logits (B, D + 1) over the accepted length 0..D."""

    def __init__(self, hidden: int, max_length: int, width: int = 256):
        super().__init__()
        self.hidden, self.max_length, self.width = hidden, max_length, width
        self.net = nn.Sequential(nn.Linear(2 * hidden, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(),
                                 nn.Linear(width, max_length + 1))

    def forward(self, feature: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([feature, embed], dim=-1).to(self.net[0].weight.dtype))

    @staticmethod
    def reach(logits: torch.Tensor) -> torch.Tensor:
        """(B, D + 1) logits -> (B, D): P(at least k accepted), k = 1..D."""
        p = torch.softmax(logits.float(), dim=-1)
        return p.flip(-1).cumsum(-1).flip(-1)[:, 1:]

    def save(self, folder: str | Path, target, about: dict | None = None) -> Path:
        meta = {"hidden": self.hidden, "max_length": self.max_length, "width": self.width, **(about or {})}
        return save_part(self, folder, "length", target, meta)


def load_length_predictor(folder: str | Path, target) -> LengthPredictor:
    """A saved predictor, checked against `target` (one trained for another target is refused)."""
    meta, weights = read_part(folder, "length", target, "length predictor", "length-predictor")
    predictor = LengthPredictor(meta["hidden"], meta["max_length"], meta["width"])
    predictor.load_state_dict(weights)
    return predictor.to(model_device(target)).eval()
