"""Parts trained for one target (feature head, exit layer, length predictor): saved as a folder of
`NAME.safetensors` and `NAME.json` (format, the target's fingerprint, the part's own settings), and
refused, when loaded, for any other target."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .parallel import whole

FORMAT = 1


def target_fingerprint(target) -> dict:
    """What identifies the target a part was trained for: its shape and a few LM-head weights."""
    head = whole(target.get_output_embeddings().weight.detach())  # sharded over ranks (--tp): the whole matrix
    if type(head) not in (torch.Tensor, nn.Parameter):  # quantized (a torchao tensor subclass): its float values
        head = head.dequantize()
    text = target.config.get_text_config()
    probe = head[:: max(head.shape[0] // 7, 1), :4].float().flatten()[:28]
    return {"model_type": text.model_type, "hidden_size": text.hidden_size, "vocab": head.shape[0],
            "lm_head_probe": [round(float(x), 4) for x in probe]}


def same_target(expected: dict, found: dict) -> bool:
    same_shape = all(expected[k] == found[k] for k in ("model_type", "hidden_size", "vocab"))
    return same_shape and max(abs(a - b) for a, b in zip(expected["lm_head_probe"], found["lm_head_probe"])) < 1e-2


@functools.cache
def _shipped_fingerprint(stem: str) -> dict | None:
    """The target fingerprint of the part shipped as `models/<stem>` (read once), None if none ships."""
    from .shipped import MODELS_DIR

    meta = MODELS_DIR / stem / f"{stem}.json"
    return json.loads(meta.read_text())["target"] if meta.is_file() else None


def shipped_part(stem: str, target) -> Path | None:
    """The folder of a part shipped inside the package (`models/<stem>`: the shipped target's feature
    head) when it was trained for `target`; else None."""
    from .shipped import shipped_path

    expected = _shipped_fingerprint(stem)
    return shipped_path(stem) if expected is not None and same_target(expected, target_fingerprint(target)) else None


def save_part(module: nn.Module, folder: str | Path, name: str, target, meta: dict) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, folder / f"{name}.safetensors")
    meta = {"format": FORMAT, "target": target_fingerprint(target), **meta}
    (folder / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    return folder


def read_part(folder: str | Path, name: str, target, what: str, command: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, weights) of a saved part, after checking it was trained for `target`. `what` names the
    part in errors ("feature head"), `command` is the `opttree train` subcommand that makes one."""
    folder = Path(folder)
    option = command.replace("-", "_")
    if not (folder / f"{name}.json").is_file() or not (folder / f"{name}.safetensors").is_file():
        raise ValueError(f"{option}={str(folder)!r}: not a saved {what} (expected {name}.json and {name}.safetensors; "
                         f"train one with `opttree train {command} --target PATH`)")
    meta = json.loads((folder / f"{name}.json").read_text())
    expected, found = meta["target"], target_fingerprint(target)
    if not same_target(expected, found):
        raise ValueError(f"{option}={str(folder)!r} was trained for another target ({expected['model_type']}, hidden "
                         f"{expected['hidden_size']}, vocabulary {expected['vocab']}); this target is "
                         f"{found['model_type']}, hidden {found['hidden_size']}, vocabulary {found['vocab']}"
                         + (" with other weights" if expected["vocab"] == found["vocab"] else ""))
    return meta, load_file(folder / f"{name}.safetensors")
