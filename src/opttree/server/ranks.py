"""A sharded target's server (`opttree serve --tp`, `opttree.parallel`): rank 0 serves HTTP and runs
several generations, one step at a time (the server's turns). Every operation that runs the sharded
target (building a generation, whose exactness probe runs forwards; each step; closing one early) is
announced to the other ranks and done under one lock, so every rank runs the same operations in the
same order. The messages: ("build", key, Call), ("step", key), ("end", key), ("ping",), ("exit",).
"""

from __future__ import annotations

import itertools
import sys
import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from ..errors import RanksDiverged
from ..parallel import rank
from ..speculator import stream

PING_SECONDS = 60.0  # an idle server's rank 0 tells the others it is alive this often

@dataclass
class Call:
    """One generation as every rank starts it: `speculator.stream(target, ids, draft if with_draft, **kwargs)`."""

    ids: list[int]
    with_draft: bool
    kwargs: dict = field(default_factory=dict)

    def start(self, target, draft, tokenizer):
        return stream(target, self.ids, draft if self.with_draft else None, tokenizer=tokenizer, **self.kwargs)


def _broadcast(message: tuple | None) -> tuple:
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Leader:
    """Rank 0 of a sharded server: builds, steps and ends generations with the other ranks (above)."""

    def __init__(self, target, draft, tokenizer):
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.lock = threading.Lock()  # one operation on the sharded target at a time, announced first
        self.keys = itertools.count()
        self.closing = threading.Event()
        threading.Thread(target=self._ping, daemon=True, name="opttree-tp-ping").start()

    def announce(self, *message) -> None:
        """Under `self.lock`: the other ranks do what `message` says, as rank 0 does now."""
        _broadcast(message)

    def build(self, call: Call) -> SharedRun:
        """`call` started on every rank; its errors (a ValueError for a bad setting) are raised here too."""
        with self.lock:
            key = next(self.keys)
            self.announce("build", key, call)
            return SharedRun(self, key, call.start(self.target, self.draft, self.tokenizer))

    def _ping(self) -> None:
        """An idle server's ranks would wait past their collectives' timeout: tell them rank 0 is alive."""
        while not self.closing.wait(PING_SECONDS):
            with self.lock:
                if not self.closing.is_set():  # after "exit", the other ranks are gone
                    self.announce("ping")

    def release(self) -> None:
        """The other ranks' `follow` returns (the server stops); once, however often it is called."""
        with self.lock:
            if not self.closing.is_set():
                self.closing.set()
                self.announce("exit")


class SharedRun:
    """Rank 0's generation of a sharded server: iterating it steps every rank's copy, one step at a time."""

    def __init__(self, leader: Leader, key: int, run):
        self.leader, self.key, self.run = leader, key, run
        self.ended = False

    @property
    def stats(self):
        return self.run.stats

    @property
    def row(self):
        """Rank 0's row of the generation (its statistics, its kept logits)."""
        return self.run.rows[0]

    def __iter__(self) -> Iterator[torch.Tensor]:
        steps = iter(self.run)
        try:
            while True:
                with self.leader.lock:
                    self.leader.announce("step", self.key)
                    try:
                        chunk = next(steps)
                    except StopIteration:
                        return
                yield chunk
        finally:
            self.end(steps)

    def end(self, steps: Iterator | None = None) -> None:
        """Every rank drops this generation (a generation stopped early stops on every rank)."""
        with self.leader.lock:
            if not self.ended:
                self.ended = True
                self.leader.announce("end", self.key)
                if steps is not None:
                    steps.close()


def follow(target, draft, tokenizer) -> int:
    """A server's rank other than 0: do what rank 0 announces, until it releases us. A generation that
    fails here failed the same way on rank 0 (which answered the error); we drop it and go on."""
    runs: dict[int, list] = {}  # key -> [generation, its step iterator once started]
    while True:
        kind, *rest = _broadcast(None)
        if kind == "exit":
            return 0
        if kind == "ping":
            continue
        key = rest[0]
        if kind == "build":
            try:
                runs[key] = [rest[1].start(target, draft, tokenizer), None]
            except (ValueError, NotImplementedError, TypeError):
                pass  # a setting the request got wrong: rank 0 answered a 400
            continue
        try:
            if kind == "step" and key in runs:
                entry = runs[key]
                entry[1] = entry[1] or iter(entry[0])
                next(entry[1], None)
            elif kind == "end" and key in runs:
                steps = runs.pop(key)[1]
                if steps is not None:
                    steps.close()
        except RanksDiverged:
            raise
        except Exception as err:  # noqa: BLE001: rank 0 reported it to its client
            runs.pop(key, None)
            print(f"opttree: rank {rank()}: a generation failed as on rank 0: {err}", file=sys.__stderr__)
