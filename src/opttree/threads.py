"""Thread settings that hold up on a shared machine, for every command (not only training).

OpenMP's default wait policy spins idle threads for a while, which is fastest on an idle machine
and ruinous on a busy one; passive waiting is the reverse. Measured on a 2-core VM, shipped pair,
bf16 (tokens/s, plain decoding / OPT-Tree): idle, spinning 115-126 / 221-223, passive 75-117 /
145-163; with one CPU-bound process beside it, spinning 23 / 2.5, passive 40 / 84. So the CLI
waits passively only when the machine is busy when it starts: other work keeps at least half the
usable cores busy, sampled from /proc/stat over BUSY_SAMPLE_S (not the load average, which stays
high for a minute after a job has ended: a benchmark started right after another ran passively, up to
1.8x slower at 8 rows). It only takes effect before torch loads its OpenMP runtime: the CLI calls
`choose_openmp_wait_policy()` before importing torch. A policy the user set is kept.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

BUSY_LOAD_PER_CORE = 0.5
BUSY_SAMPLE_S = 0.15  # how long the usable cores' activity is sampled


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's CPU set)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_is_busy() -> bool:
    """Whether other work keeps the usable cores busy now (`busy_cores`; where /proc/stat is missing, the
    1-minute load average)."""
    busy = busy_cores()
    if busy is None:
        try:
            busy = os.getloadavg()[0]
        except OSError:  # not available on this platform
            return False
    return busy >= BUSY_LOAD_PER_CORE * usable_cores()


def busy_cores(interval: float = BUSY_SAMPLE_S) -> float | None:
    """How many of the usable cores were busy over the next `interval` seconds (this process sleeps
    meanwhile), from /proc/stat; None where it cannot be read."""
    first = cpu_times()
    if first is None:
        return None
    time.sleep(interval)
    second = cpu_times()
    if second is None:
        return None
    busy, total = (b - a for a, b in zip(first, second))
    return usable_cores() * busy / total if total > 0 else None


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) clock ticks of the usable cores so far, from /proc/stat (idle and iowait are not
    busy; time stolen by the hypervisor is); None where it cannot be read."""
    cores = {f"cpu{i}" for i in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else None
    try:
        with open("/proc/stat") as stat:
            lines = [line.split() for line in stat if line.startswith("cpu") and not line.startswith("cpu ")]
    except OSError:
        return None
    rows = [[int(x) for x in line[1:9]] for line in lines if cores is None or line[0] in cores]
    if not rows:
        return None
    total = sum(sum(row) for row in rows)
    idle = sum(row[3] + row[4] for row in rows)
    return total - idle, total


def choose_openmp_wait_policy(passive: bool = False) -> str:
    """OMP_WAIT_POLICY=PASSIVE on a busy machine, or always with `passive` (training: it runs long, often
    beside other work), unless the user chose a policy. Call before torch is imported. Returns the
    policy in force ('default' = OpenMP's own)."""
    if "OMP_WAIT_POLICY" not in os.environ and (passive or machine_is_busy()):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return os.environ.get("OMP_WAIT_POLICY", "default")


def set_torch_threads() -> int:
    """torch's intra-op threads = the usable cores, unless OMP_NUM_THREADS says otherwise. Returns the count."""
    import torch

    threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or usable_cores()
    torch.set_num_threads(threads)
    return threads


_GNU_OPENMP: list = []  # [GnuOpenMP of the libgomp torch runs on, or None], found once


@dataclass(frozen=True)
class GnuOpenMP:
    """The calls into GNU OpenMP that act on the calling thread only."""

    release: Callable[[], int]  # omp_pause_resource(omp_pause_hard, the host): frees the thread's team
    set_threads: Callable[[int], None]  # omp_set_num_threads: the size of the thread's next teams


def gnu_openmp() -> GnuOpenMP | None:
    """GNU OpenMP's per-thread calls, from the libgomp this process has loaded (torch's), or None (another
    OpenMP runtime, none, not Linux, or a libgomp before GCC 9, which has no pause)."""
    if not _GNU_OPENMP:
        _GNU_OPENMP.append(_load_gnu_openmp())
    return _GNU_OPENMP[0]


def release_openmp_threads() -> bool:
    """Free the OpenMP worker threads of the calling thread, where torch runs on GNU OpenMP (Linux).

    GNU OpenMP gives every thread that runs a parallel region its own team of workers, kept for its
    life, and once the process holds more of them than there are cores, every team's workers sleep
    between regions instead of waiting awake: each parallel op then pays a wake-up. Measured on a
    2-core VM: an elementwise op in a second thread 12 -> 150 us once the main thread had run one
    (loading a model does), the shipped pair's decoding in that thread 1.9x slower. So a thread that
    has done its torch work and hands decoding to another (a server's setup, its request threads)
    calls this: its workers end (in GNU OpenMP `omp_pause_resource(omp_pause_hard, the host)` frees
    the calling thread's team only; a later parallel op of its own makes a new one). False where
    there is nothing to free this way."""
    openmp = gnu_openmp()
    return openmp is not None and openmp.release() == 0


def single_threaded_ops() -> bool:
    """Run the calling thread's torch ops on it alone, with no OpenMP team of its own (other threads keep
    theirs). For short-lived helper threads whose ops are small: each would otherwise start a team on its
    first parallel op, and their teams together make every team's workers sleep between ops
    (`release_openmp_threads`). Measured on a 2-core VM: an elementwise op on a (1, 8, 100, 64) tensor in
    a second thread 150 us with a team of its own, 15 us alone. False where torch does not use GNU OpenMP."""
    openmp = gnu_openmp()
    if openmp is None:
        return False
    import torch

    torch.get_num_threads()  # torch sets this thread's OpenMP threads on its first call: before ours
    openmp.set_threads(1)
    return True


def _load_gnu_openmp() -> GnuOpenMP | None:
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
            pause, host, threads = (library.omp_pause_resource, library.omp_get_initial_device,
                                    library.omp_set_num_threads)
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype, host.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int, ctypes.c_int
        threads.argtypes = [ctypes.c_int]
        return GnuOpenMP(release=lambda: pause(2, host()), set_threads=threads)  # 2 = omp_pause_hard
    return None
