"""What a decoding step costs the host, counted on any device: host synchronisations and device ops.

On a GPU a step is fast only if the host never waits for the device and launches few kernels. Both
are visible on a CPU too: `StepCounter` is a `TorchDispatchMode` that counts, while active,

- host syncs: reads of a device value by the host: `.item()`, `int(t)`, `float(t)`, `bool(t)`, `if t:`,
  `Tensor.tolist()` and `Tensor.numpy()` (counted as calls: under inference mode the scalar reads skip
  the dispatcher), and `aten._local_scalar_dense` dispatched from anywhere else;
- shape syncs: ops whose output shape depends on values (`nonzero`, boolean-mask indexing,
  `masked_select`, `unique`, ...), which wait for the device on CUDA;
- ops: every dispatched aten op, split into those inside a model's forward (any `nn.Module`) and the
  step's own machinery outside them (tree growth, acceptance, compaction, sampling).

`count_steps(run)` drives a `Generation` past its first chunk (prefill and first step) and counts the
rest, per step.

While counting, compiled functions run their eager code (`torch.compiler.set_stance("force_eager")`),
so the counts are those of the eager step. That stance is not a detail: torch.compile does not run
under a dispatch mode, and a compiled function first called under one is marked to run eager from
then on, in this process, also after the mode ends (measured: a bench's counted run left `--compile`
and hf-compiled at eager speed for every timed run after it).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_READS = {"_local_scalar_dense"}
_PACKAGE = Path(__file__).parent
_HOST_READS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")
_SHAPE_SYNCS = {"nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
                "unique_consecutive", "repeat_interleave"}
# indexing ops whose boolean-mask indices are turned into positions inside the op (`t[mask]`, `t[mask] = v`): no
# `nonzero` reaches the dispatcher, yet on CUDA they wait for the device as it does
_INDEXING = {"index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_"}


@dataclass(frozen=True)
class StepCosts:
    """Counts per step (averaged over `steps` steps)."""

    steps: int
    host_syncs: float  # scalar reads + tolist/numpy calls
    shape_syncs: float  # data-dependent output shapes
    ops: float  # every dispatched op
    machinery_ops: float  # ops outside any module's forward

    def as_dict(self) -> dict:
        return {"steps": self.steps, "host_syncs_per_step": round(self.host_syncs, 2),
                "shape_syncs_per_step": round(self.shape_syncs, 2), "ops_per_step": round(self.ops, 1),
                "machinery_ops_per_step": round(self.machinery_ops, 1)}


def _bool_index(args: tuple) -> bool:
    """Whether an indexing op's indices (its second argument: a list of tensors or None) hold a boolean mask."""
    indices = args[1] if len(args) > 1 else ()
    return isinstance(indices, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class StepCounter(TorchDispatchMode):
    """Counts host syncs and ops while active (see the module docstring). `by_op` names the host syncs'
    and shape syncs' ops; with `where=True`, `by_line` counts them by the innermost line of opttree's
    own code that caused them ("engine.py:212 __int__"), for finding where they come from."""

    def __init__(self, where: bool = False):
        super().__init__()
        self.where = where
        self.by_line: Counter = Counter()
        self.host_syncs = self.shape_syncs = self.ops = self.machinery_ops = 0
        self.by_op: Counter = Counter()
        self._inside = 0  # nesting depth of module forwards
        self._reading = 0  # inside a counted host read (its own scalar reads are not counted again)
        self._handles: list = []
        self._patched: dict = {}
        self._stance = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops += 1
        if not self._inside:
            self.machinery_ops += 1
        if name in _SCALAR_READS:
            if self._reading:
                return func(*args, **(kwargs or {}))
            self.host_syncs += 1
            self._note(name)
        elif name in _SHAPE_SYNCS or (name in _INDEXING and _bool_index(args)):
            self.shape_syncs += 1
            self._note(name)
        return func(*args, **(kwargs or {}))

    def _note(self, name: str) -> None:
        self.by_op[name] += 1
        if self.where:
            frame = sys._getframe(2)
            while frame is not None and not (_PACKAGE in Path(frame.f_code.co_filename).parents
                                             and Path(frame.f_code.co_filename).name != "counters.py"):
                frame = frame.f_back
            place = "?" if frame is None else f"{Path(frame.f_code.co_filename).relative_to(_PACKAGE)}:{frame.f_lineno}"
            self.by_line[f"{place} {name}"] += 1

    def _count_call(self, method: str):
        original = self._patched[method]

        def counted(tensor, *args, **kwargs):
            if self._reading:
                return original(tensor, *args, **kwargs)
            self.host_syncs += 1
            self._note(method)
            self._reading += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._reading -= 1

        return counted

    def __enter__(self):
        def enter(module, args):
            self._inside += 1

        def leave(module, args, output):
            self._inside -= 1

        self._handles = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
                         torch.nn.modules.module.register_module_forward_hook(leave)]
        for method in _HOST_READS:
            self._patched[method] = getattr(torch.Tensor, method)
            setattr(torch.Tensor, method, self._count_call(method))
        self._stance = torch.compiler.set_stance("force_eager")  # the module docstring: why
        self._stance.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        for method, original in self._patched.items():
            setattr(torch.Tensor, method, original)
        self._patched.clear()
        result = super().__exit__(*exc)
        self._stance.__exit__(*exc)
        return result


def count_steps(run, where: bool = False) -> tuple[StepCosts, StepCounter]:
    """Run the `Generation` `run` to its end, counting every step after the first (the prefill and the
    first step are left out). Returns the per-step costs and the counter (for `by_op`)."""
    chunks = iter(run)
    next(chunks)
    first = run.stats.steps
    counter = StepCounter(where)
    with counter:
        for _ in chunks:
            pass
    steps = max(run.stats.steps - first, 1)
    return StepCosts(steps, counter.host_syncs / steps, counter.shape_syncs / steps, counter.ops / steps,
                     counter.machinery_ops / steps), counter
