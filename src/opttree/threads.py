"""Thread settings that hold up on a shared machine, for every command (not only training).

With OpenMP's default (spinning) wait policy, torch's threads on a 2-core machine shared with any
other busy process slow down ~10x; passive waiting avoids it. It only takes effect when set before
torch loads its OpenMP runtime, so the CLI calls `passive_openmp()` before importing torch.
"""

from __future__ import annotations

import os


def passive_openmp() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the user chose one. Call before torch is imported."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's CPU set)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_torch_threads() -> int:
    """torch's intra-op threads = the usable cores, unless OMP_NUM_THREADS says otherwise. Returns the count."""
    import torch

    threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or usable_cores()
    torch.set_num_threads(threads)
    return threads
