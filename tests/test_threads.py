"""`opttree.threads`: a thread that hands decoding to another lets its OpenMP workers go
(`release_openmp_threads`: GNU OpenMP keeps a team per thread, and more teams than cores make every
team's workers sleep between ops), and a helper thread can run its ops with no team at all
(`single_threaded_ops`)."""

import os
import sys
import threading
import time

import pytest
import torch

from opttree.threads import release_openmp_threads, single_threaded_ops

linux_gomp = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GNU OpenMP's thread teams (Linux)")


def _threads() -> set[str]:
    """The process's OS thread ids now (other threads may start or end meanwhile: compare sets, not counts)."""
    return set(os.listdir("/proc/self/task"))


def _gone(ids: set[str]) -> set[str]:
    """Those of `ids` still alive once they end (workers end asynchronously), or after 2 s."""
    deadline = time.monotonic() + 2
    while ids & _threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return ids & _threads()


@linux_gomp
def test_releasing_ends_the_calling_threads_openmp_workers_and_only_those():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite runs one intra-op thread: a team of two here
    seen = {}

    def worker():
        before = _threads()
        torch.ones(1 << 20).mul_(2)  # large enough to run in parallel: this thread's team starts
        team = _threads() - before
        seen["team"] = len(team)
        seen["released"] = release_openmp_threads()
        seen["left"] = len(_gone(team))
        torch.ones(1 << 20).mul_(2)  # a later parallel op of its own makes a new team, and is right
        seen["again"] = len(_threads() - before - team)

    thread = threading.Thread(target=worker)
    try:
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(threads)
    if seen["team"] == 0:
        pytest.skip("this torch runs its parallel ops without starting OpenMP workers here")
    assert seen["released"] is True
    assert seen["team"] == 1  # the calling thread is the team's first member
    assert seen["left"] == 0
    assert seen["again"] == seen["team"]


def test_releasing_with_no_workers_is_harmless():
    assert release_openmp_threads() in (True, False)
    assert torch.equal(torch.arange(4) * 2, torch.tensor([0, 2, 4, 6]))


@linux_gomp
def test_single_threaded_ops_start_no_team_in_that_thread_only():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = {}

    def worker():
        seen["set"] = single_threaded_ops()
        before = _threads()
        seen["result"] = torch.ones(1 << 20).mul_(2).sum().item()  # large enough to run in parallel
        seen["team"] = len(_threads() - before)
        seen["threads"] = torch.get_num_threads()

    thread = threading.Thread(target=worker)
    try:
        thread.start()
        thread.join()
        assert torch.get_num_threads() == 2  # the other threads keep theirs
    finally:
        torch.set_num_threads(threads)
    assert seen == {"set": True, "result": 2.0 * (1 << 20), "team": 0, "threads": 1}
