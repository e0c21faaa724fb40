"""What the machine can do, as far as speed settings care: the key profiles are stored under, and
the measured choice between bfloat16 and float32 (`--dtype auto`).

A profile measured on one CPU must not be applied on another: with hardware bf16 (avx512_bf16 /
AMX) a bf16 forward over 17 tokens costs ~1.1x one token; restricted to AVX2 it costs ~5x (docs/BENCHMARKS.md,
"Other CPUs"). `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` reproduce such a CPU, and the key
follows them.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

import torch

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return frozenset()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def bf16_hardware() -> bool:
    """Whether bf16 matrix products run on bf16 instructions here (not restricted away by the
    ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA environment variables)."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    restricted = not (isa == "ALL" or isa.startswith(("AVX512_CORE_BF16", "AVX512_CORE_AMX", "AVX10")))
    capable = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return bool(_cpu_flags() & set(BF16_FLAGS)) and capable and not restricted


def hardware_key(device: torch.device | str = "cpu") -> dict:
    """The facts a speed profile depends on. Two machines with equal keys share profiles."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"device": "cuda", "name": torch.cuda.get_device_name(device)}
    if device.type != "cpu":
        return {"device": device.type}
    return {"device": "cpu", "cpu_capability": torch.backends.cpu.get_cpu_capability(), "bf16_hardware": bf16_hardware()}


def describe(key: dict) -> str:
    if key.get("device") != "cpu":
        return ", ".join(str(v) for v in key.values())
    return f"CPU {key['cpu_capability']}, {'with' if key['bf16_hardware'] else 'no'} bf16 hardware"


def forward_ms(model, k: int, context: int = 128, repeats: int = 5) -> float:
    """Median ms of one forward over k new tokens after `context` cached ones (causal, no tree)."""
    from .packed import packed_models
    from .step.cache import cache_argument, new_cache, truncate

    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.arange(context + k, device=device) % vocab
    times = []
    with torch.inference_mode(), packed_models(model):  # as a generation runs it
        cache = new_cache(model)
        model(input_ids=ids[None, :context], **{cache_argument(model): cache})
        for _ in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            model(input_ids=ids[None, context:], **{cache_argument(model): cache})
            times.append(time.perf_counter() - start)
            truncate(cache, context)
    return 1000 * statistics.median(times[1:])


def choose_dtype(step_ms: dict[str, float], bf16_hardware: bool = True) -> str:
    """The dtype whose measured step costs least. On a tie within 5 %: bfloat16 where the CPU has bf16
    hardware (half the memory), float32 where it has not (there bfloat16's cost grows faster with the
    tree's size than the measured step shows, and float32 is the exact reference).
    step_ms: {dtype name: ms of a target forward over budget + 1 tokens (+ the draft's)}."""
    best = min(step_ms, key=step_ms.get)
    tie = "bfloat16" if bf16_hardware else "float32"
    if tie in step_ms and step_ms[tie] <= 1.05 * step_ms[best]:
        return tie
    return best


# ---- what a report says of the machine ---------------------------------------------------------


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "processor": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),  # PASSIVE when started on a busy machine
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
