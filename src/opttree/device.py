"""Where a model lives, and what timing and random numbers need there.

Every tensor of a generation is created on its model's device; the engine never moves a model.
"""

from __future__ import annotations

import time
from functools import lru_cache

import numpy as np
import torch
from transformers import PreTrainedModel


def model_device(model: PreTrainedModel) -> torch.device:
    """The device of the model's input embeddings: where its input ids must be."""
    return model.get_input_embeddings().weight.device


def on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`: itself where it is there already (no op dispatched: on the hot path, the step's
    machinery counts its ops)."""
    return tensor if tensor.device == device else tensor.to(device)


def host_tensor(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A list the host holds, as a tensor on `device`, without waiting for the device: on a GPU through pinned
    memory and an asynchronous copy (a plain `torch.tensor(values, device=...)` copies from pageable memory, which
    synchronises the stream: a host sync the step's counters do not see on a CPU)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def host_array(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`host_tensor` for a numpy array: the array itself on a CPU (no copy), else one asynchronous copy from pinned
    memory."""
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.pin_memory().to(device, non_blocking=True)


@lru_cache(maxsize=256)
def constant(values: tuple, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of host-known values that steps use again and again (a tree's depths by layer sizes, a row index),
    made once per (values, device, dtype) and shared: read only. No op on the hot path after the first step."""
    return host_tensor(list(values), device, dtype)


def dtype_name(model: PreTrainedModel) -> str:
    """The model's dtype as the --dtype flags spell it: "bfloat16", "float32", ..."""
    return str(model.dtype).removeprefix("torch.")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock reading after it is true (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def seconds_since(start: float, model: PreTrainedModel) -> float:
    """Wall time since `start` (perf_counter), after the model's device has finished its work."""
    synchronize(model.device)
    return time.perf_counter() - start


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A per-request RNG on `device`. A seed outside [0, 2**64) is an error, not silently wrapped."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return torch.Generator(device=device).manual_seed(seed)


class PhaseClock:
    """Marks on the device's timeline, to split a step into draft / verify without stalling it:
    CUDA events on a GPU (read once the step has synchronised anyway), the host clock elsewhere."""

    def __init__(self, device: torch.device):
        self.events = device.type == "cuda"

    def mark(self):
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1000 if self.events else end - start


COMPILED_VERSIONS = 64


def compile_model(model: PreTrainedModel, static: bool = True) -> PreTrainedModel:
    """Compile the model's forward with torch.compile. In place; returns the model. The first calls
    compile (about a minute for the shipped target on a 2-core CPU), so it pays for long runs
    (benchmarks, servers), not for one prompt.

    static=True: a separate step function for the static path's fixed-shape forwards (`static_step`),
    compiled for fixed shapes (one compilation per shape and capacity bucket), with CUDA graphs on a
    GPU; the forward stays eager for the prefill, whose length changes with every prompt. A target's
    generations then take the static path unless told otherwise, and a draft model compiled so drafts
    in fixed shapes on that path (`drafters.StaticModelDrafter`: its roots and tree layers through the
    step; what pays on a GPU, while on a CPU its dynamic-shape compile, static=False, measured faster).
    static=False: the forward itself, with dynamic shapes (trees and caches change size every step:
    the dynamic path, and a batch's draft)."""
    # dynamo keeps at most `recompile_limit` (8) compiled versions per code object, and every model's
    # forward is the same code: a target's step per budget and capacity bucket, a draft's few call
    # patterns, a second model... past 8, every call silently runs eager. Allow many more.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_VERSIONS)
    if static:
        if not has_static_step(model):
            graphs = model_device(model).type == "cuda"
            model._opttree_static_step = _fixed_shape_step(model.forward, graphs)
        return model
    if not getattr(model, "_opttree_compiled", False):
        model.forward = torch.compile(model.forward, dynamic=True)
        model._opttree_compiled = True
    return model


def has_static_step(model: PreTrainedModel) -> bool:
    return hasattr(model, "_opttree_static_step")


def is_compiled(model: PreTrainedModel) -> bool:
    """Whether `compile_model` compiled the model's forward or a fixed-shape step of it."""
    return getattr(model, "_opttree_compiled", False) or has_static_step(model)


def static_step(model: PreTrainedModel):
    """What runs a static-path tree forward: the compiled step of `compile_model(model, static=True)`,
    else the model itself."""
    return getattr(model, "_opttree_static_step", model)


def _fixed_shape_step(forward, graphs: bool):
    compiled = torch.compile(forward, dynamic=False, mode="reduce-overhead" if graphs else None)
    if not graphs:
        return compiled

    def step(**inputs):
        torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs are no longer read
        out = compiled(**inputs)
        # copies: a graph's outputs are overwritten by its next replay, and a drafter may keep them
        out.logits = out.logits.clone()
        if out.hidden_states is not None:
            out.hidden_states = tuple(h.clone() for h in out.hidden_states)
        return out

    return step
