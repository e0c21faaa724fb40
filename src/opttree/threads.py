"""Thread settings that hold up on a shared machine, for every command (not only training).

OpenMP's default wait policy spins idle threads for a while, which is fastest on an idle machine
and ruinous on a busy one; passive waiting is the reverse. Measured on a 2-core VM, shipped pair,
bf16 (tokens/s, plain decoding / OPT-Tree): idle, spinning 115-126 / 221-223, passive 75-117 /
145-163; with one CPU-bound process beside it, spinning 23 / 2.5, passive 40 / 84. So the CLI
waits passively only when the machine is busy when it starts (load average >= half the usable
cores). It only takes effect before torch loads its OpenMP runtime: the CLI calls
`choose_openmp_wait_policy()` before importing torch. A policy the user set is kept.
"""

from __future__ import annotations

import os

BUSY_LOAD_PER_CORE = 0.5


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's CPU set)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_is_busy() -> bool:
    """Whether other work already keeps the usable cores busy (1-minute load average)."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return False
    return load >= BUSY_LOAD_PER_CORE * usable_cores()


def choose_openmp_wait_policy() -> str:
    """OMP_WAIT_POLICY=PASSIVE on a busy machine, unless the user chose a policy. Call before torch
    is imported. Returns the policy in force ('default' = OpenMP's own)."""
    if "OMP_WAIT_POLICY" not in os.environ and machine_is_busy():
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return os.environ.get("OMP_WAIT_POLICY", "default")


def set_torch_threads() -> int:
    """torch's intra-op threads = the usable cores, unless OMP_NUM_THREADS says otherwise. Returns the count."""
    import torch

    threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or usable_cores()
    torch.set_num_threads(threads)
    return threads
