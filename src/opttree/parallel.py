"""Tensor-parallel targets (`--tp`, under `torchrun`): the target is sharded by transformers' own tensor
parallelism (`from_pretrained(path, tp_plan="auto")`); everything else (the draft, the tree, acceptance,
sampling) runs replicated and deterministic on every rank. Rank 0 speaks (prints, writes files, serves
HTTP); the other ranks compute beside it and stay silent.

What keeps the ranks in step, with no transport of opttree's own (torch.distributed's collectives):
- every choice a rank makes from the same flags and files is the same on every rank; choices that measure
  this machine (the first-use calibration, `--dtype auto`'s timing on a CPU) are not made under `--tp`,
  and the tree settings each rank resolved are compared once (`same_everywhere`);
- after every step, `Lockstep.exchange` compares a digest of each rank's committed tokens (a difference
  raises `RanksDiverged` on every rank, never a silent wrong answer), gives every rank rank 0's step
  timings (the one input of a depth control that measures time), and carries rank 0's stop when its
  consumer abandons a generation (a server's cancelled request);
- a server's rank 0 announces every operation on the sharded target and the other ranks repeat it, in
  the same order (`opttree.server.ranks`).

A rank that dies is noticed by `torchrun`, which ends the others with an error.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import RanksDiverged

TIMEOUT = timedelta(minutes=10)  # a collective that waits longer fails (a rank stuck, not dead)


def launched() -> bool:
    """Whether this process is one of several that torchrun (or a launcher like it) started."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def is_main() -> bool:
    return rank() == 0


def start(device: torch.device) -> None:
    """Join the ranks `torchrun` started (gloo on a CPU, NCCL on CUDA). A clear error outside torchrun."""
    if not launched():
        raise ValueError("--tp shards the target over the processes torchrun starts: run "
                         "`torchrun --nproc-per-node K -m opttree COMMAND ... --tp` (K ranks, one per device or CPU "
                         "share); without torchrun, leave --tp out")
    if not dist.is_initialized():
        if device.type == "cuda":  # one GPU per rank, before NCCL starts
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
        atexit.register(_leave)  # a group left to the interpreter's teardown can abort the process at exit


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def check_plan(config, path) -> None:
    """Architectures transformers cannot shard (no `base_model_tp_plan`) are refused before loading."""
    text = config.get_text_config()
    if not getattr(text, "base_model_tp_plan", None):
        raise ValueError(f"--tp: {path} is a {text.model_type!r} model, for which transformers has no tensor-parallel "
                         "plan (`base_model_tp_plan`); run it on one device (leave --tp out)")


def sharded(model) -> bool:
    """Whether `model`'s weights are spread over ranks (distributed tensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of `tensor`'s full value (a sharded DTensor is gathered; anything else is returned)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def same_everywhere(value, what: str):
    """`value` as this rank resolved it, after checking that every rank resolved the same."""
    if not active():
        return value
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if any(v != values[0] for v in values):
        differing = next(r for r, v in enumerate(values) if v != values[0])
        raise RanksDiverged(f"the ranks resolved different {what}: rank 0 {values[0]!r}, rank {differing} "
                            f"{values[differing]!r} (a calibration profile or cache present on some machines only?)")
    return value


def _digest(committed: torch.Tensor) -> torch.Tensor:
    """() float64: a position-weighted checksum of the (T,) committed tokens, exact below 2^53."""
    weights = torch.arange(committed.shape[0], device=committed.device) % 1009 + 1
    return ((committed + 1) * weights).sum().double()


@dataclass
class Lockstep:
    """The per-step exchange of a sharded generation (see the module's docstring)."""

    steps: int = 0

    def exchange(self, committed: torch.Tensor, timings: tuple[float, float], stop: bool = False
                 ) -> tuple[bool, tuple[float, float]]:
        """(whether some rank stopped, rank 0's (draft_s, verify_s)); RanksDiverged if the tokens differ."""
        device = _collective_device()
        mine = torch.stack([torch.tensor(float(stop), dtype=torch.float64, device=committed.device),
                            torch.tensor(float(committed.shape[0]), dtype=torch.float64, device=committed.device),
                            _digest(committed),
                            *(torch.tensor(t, dtype=torch.float64, device=committed.device) for t in timings)]).to(device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        table = torch.stack(rows).cpu()  # (ranks, 5): stop, length, digest, draft_s, verify_s
        self.steps += 1
        if not torch.equal(table[:, 1:3], table[:1, 1:3].expand(table.shape[0], 2)):
            lengths = table[:, 1].long().tolist()
            raise RanksDiverged(f"tensor-parallel ranks diverged at step {self.steps}: their committed tokens differ "
                                f"(lengths {lengths}); a nondeterministic draft or sampler, or ranks loaded "
                                "different models")
        return bool(table[:, 0].any()), (float(table[0, 3]), float(table[0, 4]))


def lockstep_for(target) -> Lockstep | None:
    """A Lockstep for a generation whose target is sharded over the ranks, else None."""
    return Lockstep() if active() and sharded(target) else None
