"""Continuous batching for `opttree serve`: one running batch (`opttree.engine.Generation`) that
requests join between two steps, in arrival order, up to `max_rows` at once, and leave when they
finish, fail or are cancelled (the client left, or the shutdown grace ran out). Each request keeps
its own row: its settings, random stream, stop rule and stream of chunks. One thread steps the batch;
the HTTP handlers' threads read their request's chunks from a queue."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable, Iterator

from ..engine import Allocator, Generation, Row
from ..threads import release_openmp_threads

_END = object()  # a job's queue: no more chunks


class BatchJob:
    """One request's place in the batch: its row and the chunks the scheduler hands it."""

    def __init__(self, row: Row, expired: threading.Event, batcher: "Batcher"):
        self.row, self.expired, self.batcher = row, expired, batcher
        self.cancelled = threading.Event()
        self.complete = False  # the row ran to its end (length, EOS or stop)
        self.joined, self.waited_s = time.perf_counter(), None  # seconds before it joined the batch, once it did
        self._chunks: queue.Queue = queue.Queue()
        self._ended = threading.Event()

    @property
    def stats(self):
        return self.row.stats

    def stopped(self) -> bool:
        return self.cancelled.is_set() or self.expired.is_set()

    def chunks(self) -> Iterator[list[int]]:
        """The row's chunks as the scheduler emits them; ends when the row does (an error is raised here)."""
        while (item := self._chunks.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def result(self) -> list[list[int]]:
        """Every chunk, once the row has ended: its thread wakes once, not at every step (on a 2-core CPU the
        batch's forward shares the cores with whatever wakes)."""
        self._ended.wait()
        return list(self.chunks())

    def close(self) -> None:
        """Stop: a waiting request leaves the line now, a running one the batch before its next step."""
        self.batcher.withdraw(self)

    def put(self, chunk: list[int]) -> None:
        self._chunks.put(chunk)

    def end(self, complete: bool = False, error: BaseException | None = None) -> None:
        self.complete = complete
        if error is not None:
            self._chunks.put(error)
        self._chunks.put(_END)
        self._ended.set()


class Batcher:
    """The scheduler: a thread that admits waiting jobs (first come, first served: none starves), drops
    the stopped ones and steps the batch. `on_step(rows, tokens, drafted)` observes each step: how many
    rows ran, the tokens they emitted, the draft nodes each row verified. `allocator`: how the rows
    share a step (one node budget for the batch, or each tree sized for the rows decoding), None: a tree each."""

    def __init__(self, target, max_rows: int, on_step: Callable[[int, int, list[int]], None] = lambda *_: None,
                 allocator: Allocator | None = None):
        if max_rows < 1:
            raise ValueError(f"--max-batch must be >= 1, got {max_rows}")
        self.target, self.max_rows, self.on_step, self.allocator = target, max_rows, on_step, allocator
        self.waiting: deque[BatchJob] = deque()
        self.changed = threading.Condition()
        self.run: Generation | None = None
        self.jobs: dict[int, BatchJob] = {}  # row index in `run` -> its job
        threading.Thread(target=self._loop, daemon=True, name="opttree-batch").start()

    def submit(self, job: BatchJob) -> None:
        with self.changed:
            self.waiting.append(job)
            self.changed.notify()

    def withdraw(self, job: BatchJob) -> None:
        """A job that leaves before it joined the batch ends now; one in the batch at the next step."""
        job.cancelled.set()
        with self.changed:
            if job in self.waiting:
                self.waiting.remove(job)
                job.end()
            self.changed.notify()

    def running(self) -> int:
        """Rows in the batch now."""
        return len(self.jobs)

    def _loop(self) -> None:
        while True:
            with self.changed:
                if not self.waiting and not self.jobs:
                    release_openmp_threads()  # idle: its OpenMP workers go, not to slow another thread's
                while not self.waiting and not self.jobs:
                    self.changed.wait()
                room = self.max_rows - len(self.jobs)
                arrivals = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
            try:
                self._turn(arrivals)
            except Exception as err:  # never leave the scheduler dead: the batch's requests fail, the next start afresh
                with self.changed:
                    queued = set(map(id, self.waiting))
                running = list(self.jobs.values())
                for job in running + [j for j in arrivals if id(j) not in queued and j not in running]:
                    job.end(error=err)
                self.jobs.clear()
                self.run = None

    def _turn(self, arrivals: list[BatchJob]) -> None:
        """Between two steps: the stopped rows leave, the arrivals join (in order), then one step."""
        for b in [b for b, job in self.jobs.items() if job.stopped()]:
            self.run.cancel(b)
            self.jobs.pop(b).end()
        arrivals = self._admit_together(arrivals)
        for i, job in enumerate(arrivals):
            if not self._admit(job):  # it decodes alone: first in line again, once the batch has drained
                with self.changed:
                    self.waiting.extendleft(reversed(arrivals[i:]))
                break
        if self.jobs:
            self._step()

    def _admit_together(self, arrivals: list[BatchJob]) -> list[BatchJob]:
        """The arrivals join the batch in one prefill (`Generation.admit_all`); returns those left to admit
        one at a time: all of them when that fails, so that a request that cannot share a batch, or whose
        prefill fails, is found alone and the others join."""
        live = []
        for job in arrivals:
            if job.stopped():
                job.end()
            else:
                live.append(job)
        if len(live) < 2:
            return live
        try:
            self._join(live)
        except Exception:  # noqa: BLE001 - each is admitted alone instead, and fails alone if it fails
            return live
        return []

    def _admit(self, job: BatchJob) -> bool:
        """`job` joins the batch, or ends (stopped, or failed alone); False: it cannot share a batch
        (e.g. the early-exit source, a target verified as chains) and must wait for this one to end."""
        if job.stopped():
            job.end()
            return True
        try:
            self._join([job])
        except NotImplementedError:
            return False
        except Exception as err:  # this request fails; the batch goes on
            job.end(error=err)
        return True

    def _join(self, jobs: list[BatchJob]) -> None:
        """The jobs' rows join the batch (a new one if none runs), prefilled now in one forward; if that
        raises, none of them joins."""
        rows = [job.row for job in jobs]
        if self.run is None or self.run.ended:
            run = Generation(self.target, rows, width=0, static=False, batch=True, allocator=self.allocator)
            run.begin()
            self.run, indices = run, list(range(len(rows)))
        else:
            indices = self.run.admit_all(rows)
        now = time.perf_counter()
        for b, job in zip(indices, jobs):
            job.waited_s = now - job.joined
            self.jobs[b] = job

    def _step(self) -> None:
        drafted = {b: job.stats.drafted_tokens for b, job in self.jobs.items()}
        try:
            pairs = self.run.step()
        except Exception as err:  # the step failed: every row in it fails, the next requests start afresh
            for job in self.jobs.values():
                job.end(error=err)
            self.jobs.clear()
            self.run = None
            return
        tokens = 0
        for b, chunk in pairs:
            tokens += chunk.shape[0]
            self.jobs[b].put(chunk.tolist())
        self.on_step(len(pairs), tokens, [self.jobs[b].stats.drafted_tokens - drafted[b] for b, _ in pairs])
        for b in [b for b in self.jobs if self.run.rows[b].finished]:
            self.jobs.pop(b).end(complete=True)
