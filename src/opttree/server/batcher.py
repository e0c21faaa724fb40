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

import torch

from ..batch_sizing import fits
from ..engine import Allocator, Generation, Row, check_batchable, prefill_groups
from ..threads import release_openmp_threads
from .logprobs import Chunk, TokenLogprob, chunk_of, token_logprobs

_END = object()  # a job's queue: no more chunks


def job_groups(jobs: list["BatchJob"]) -> list[list["BatchJob"]]:
    """The jobs in groups that share a prefill (`engine.prefill_groups` of their prompts' lengths)."""
    return [[jobs[i] for i in group] for group in prefill_groups([job.row.prompt_len for job in jobs])]


class BatchJob:
    """One request's place in the batch: its row and the chunks the scheduler hands it."""

    def __init__(self, row: Row, expired: threading.Event, batcher: "Batcher", logprobs: int | None = None):
        self.row, self.expired, self.batcher = row, expired, batcher
        self.logprobs = logprobs  # the likeliest tokens to report at each new token; None: no log-probabilities
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

    def chunks(self) -> Iterator[Chunk]:
        """The row's chunks as the scheduler emits them; ends when the row does (an error is raised here)."""
        while (item := self._chunks.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def result(self) -> list[Chunk]:
        """Every chunk, once the row has ended: its thread wakes once, not at every step (on a 2-core CPU the
        batch's forward shares the cores with whatever wakes)."""
        self._ended.wait()
        return list(self.chunks())

    def close(self) -> None:
        """Stop: a waiting request leaves the line now, a running one the batch before its next step."""
        self.batcher.withdraw(self)

    def put(self, chunk: torch.Tensor) -> None:
        """The (C,) tokens its row emitted this step."""
        self._chunks.put(chunk_of(chunk, self.row, self.logprobs))

    def end(self, complete: bool = False, error: BaseException | None = None) -> None:
        self.complete = complete
        if error is not None:
            self._chunks.put(error)
        self._chunks.put(_END)
        self._ended.set()


class Scoring:
    """A prompt whose tokens' log-probabilities the scheduler computes between two steps (an echoed prompt's)."""

    def __init__(self, ids: list[int], k: int):
        self.ids, self.k = ids, k
        self.done = threading.Event()
        self.result: list[TokenLogprob] | BaseException = []

    def run(self, target) -> None:
        try:
            with torch.inference_mode():
                ids = torch.tensor([self.ids], device=target.device)  # (1, P)
                logits = target(ids, use_cache=False).logits[0, :-1]  # (P - 1, V): each predicts the next token
            self.result = token_logprobs(logits, ids[0, 1:], self.k)
        except Exception as err:  # noqa: BLE001 - its request gets the error, the batch goes on
            self.result = err
        self.done.set()


class Lane:
    """One running batch (`Generation`) and its jobs: requests whose lengths are close enough to share a
    cache that pads every row to the longest (`fits`)."""

    def __init__(self):
        self.run: Generation | None = None
        self.jobs: dict[int, BatchJob] = {}  # row index in `run` -> its job

    def lengths(self) -> list[int]:
        """The positions each running row holds now (prompt and tokens emitted)."""
        return [job.row.prefix_len for job in self.jobs.values()]

    def join(self, jobs: list[BatchJob], target, allocator: Allocator | None, rows_room: int = 0) -> None:
        """The jobs' rows join this lane's batch (a new one if none runs, its cache with room for `rows_room` rows),
        prefilled now in one forward; if that raises, none of them joins."""
        rows = [job.row for job in jobs]
        if self.run is None or self.run.ended:
            run = Generation(target, rows, width=0, static=False, batch=True, allocator=allocator, rows_room=rows_room)
            run.begin()
            self.run, indices = run, list(range(len(rows)))
        else:
            indices = self.run.admit_all(rows)
        now = time.perf_counter()
        for b, job in zip(indices, jobs):
            job.waited_s = now - job.joined
            self.jobs[b] = job

    def drop_stopped(self) -> None:
        for b in [b for b, job in self.jobs.items() if job.stopped()]:
            self.run.cancel(b)
            self.jobs.pop(b).end()

    def fail(self, err: BaseException) -> None:
        for job in self.jobs.values():
            job.end(error=err)
        self.jobs.clear()
        self.run = None

    def step(self, on_step: Callable[[int, int, list[int], float], None]) -> None:
        drafted = {b: job.stats.drafted_tokens for b, job in self.jobs.items()}
        began = time.perf_counter()
        try:
            pairs = self.run.step()
        except Exception as err:  # the step failed: every row in it fails, the next requests start afresh
            self.fail(err)
            return
        seconds = time.perf_counter() - began
        tokens = 0
        for b, chunk in pairs:
            tokens += chunk.shape[0]
            self.jobs[b].put(chunk)
        on_step(len(pairs), tokens, [self.jobs[b].stats.drafted_tokens - drafted[b] for b, _ in pairs], seconds)
        for b in [b for b in self.jobs if self.run.rows[b].finished]:
            self.jobs.pop(b).end(complete=True)


class Batcher:
    """The scheduler: a thread that admits waiting jobs (first come, first served: none starves), drops the
    stopped ones and steps the running batches. Requests of similar lengths share a batch (a `Lane`), those of very
    different lengths run in lanes of their own, stepped in turn (a step of each lane a turn). `on_step(rows, tokens,
    drafted, seconds)` observes each step: how many rows ran, the tokens they emitted, the draft nodes each row
    verified, how long it took.
    `allocator`: how the rows share a step (one node budget for the batch, or each tree sized for the rows
    decoding), None: a tree each."""

    def __init__(self, target, max_rows: int, on_step: Callable[[int, int, list[int], float], None] = lambda *_: None,
                 allocator: Allocator | None = None):
        if max_rows < 1:
            raise ValueError(f"--max-batch must be >= 1, got {max_rows}")
        self.target, self.max_rows, self.on_step, self.allocator = target, max_rows, on_step, allocator
        self.waiting: deque[BatchJob] = deque()
        self.scorings: deque[Scoring] = deque()  # prompts to score before the next step
        self.changed = threading.Condition()
        self.lanes: list[Lane] = []
        threading.Thread(target=self._loop, daemon=True, name="opttree-batch").start()

    def submit(self, job: BatchJob) -> None:
        with self.changed:
            self.waiting.append(job)
            self.changed.notify()

    def score(self, ids: list[int], k: int) -> list[TokenLogprob]:
        """The log-probabilities of `ids[1:]` under the target (one forward over them, run by the scheduler between
        two steps) with the `k` likeliest tokens at each; blocks until they are known."""
        scoring = Scoring(ids, k)
        with self.changed:
            self.scorings.append(scoring)
            self.changed.notify()
        scoring.done.wait()
        if isinstance(scoring.result, BaseException):
            raise scoring.result
        return scoring.result

    def withdraw(self, job: BatchJob) -> None:
        """A job that leaves before it joined the batch ends now; one in the batch at the next step."""
        job.cancelled.set()
        with self.changed:
            if job in self.waiting:
                self.waiting.remove(job)
                job.end()
            self.changed.notify()

    def running(self) -> int:
        """Rows in the running batches now."""
        return sum(len(lane.jobs) for lane in self.lanes)

    def batches(self) -> int:
        """Batches (lanes) running now."""
        return sum(1 for lane in self.lanes if lane.jobs)

    def _loop(self) -> None:
        while True:
            with self.changed:
                if not self.waiting and not self.running():
                    release_openmp_threads()  # idle: its OpenMP workers go, not to slow another thread's
                while not self.waiting and not self.running() and not self.scorings:
                    self.changed.wait()
                room = self.max_rows - self.running()
                arrivals = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
                scorings, self.scorings = list(self.scorings), deque()
            for scoring in scorings:
                scoring.run(self.target)
            try:
                self._turn(arrivals)
            except Exception as err:  # never leave the scheduler dead: the batch's requests fail, the next start afresh
                with self.changed:
                    queued = set(map(id, self.waiting))
                running = [job for lane in self.lanes for job in lane.jobs.values()]
                for job in running + [j for j in arrivals if id(j) not in queued and j not in running]:
                    job.end(error=err)
                self.lanes = []

    def _turn(self, arrivals: list[BatchJob]) -> None:
        """Between two steps: the stopped rows leave, the arrivals join (in order), then one step of each lane."""
        for lane in self.lanes:
            lane.drop_stopped()
        self.lanes = [lane for lane in self.lanes if lane.jobs]
        arrivals = self._admit_together(arrivals)
        for i, job in enumerate(arrivals):
            if not self._admit(job):  # it decodes alone: first in line again, once the batches have drained
                with self.changed:
                    self.waiting.extendleft(reversed(arrivals[i:]))
                break
        for lane in self.lanes:
            if lane.jobs:
                lane.step(self.on_step)

    def _admit_together(self, arrivals: list[BatchJob]) -> list[BatchJob]:
        """The arrivals join the batches in one prefill (`Generation.admit_all`) per group of similar prompt lengths
        (`job_groups`); returns those left to admit one at a time: the groups of one, and a group whose
        prefill failed, so that a request that cannot share a batch, or whose prefill fails, is found alone and
        the others join."""
        live = []
        for job in arrivals:
            if job.stopped():
                job.end()
            else:
                live.append(job)
        alone = []
        for group in job_groups(live):
            if len(group) < 2:
                alone += group
                continue
            try:
                self._join(group)
            except Exception:  # noqa: BLE001 - each is admitted alone instead, and fails alone if it fails
                alone += group
        return alone

    def _admit(self, job: BatchJob) -> bool:
        """`job` joins a batch, or ends (stopped, or failed alone); False: it cannot share a batch (e.g. the
        early-exit source, a target verified as chains) and must wait for the running ones to end."""
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
        """The jobs join the lane their lengths fit (`fits`; the fullest such), else a lane of their own. A lane
        that cannot take them (a row that cannot share a batch, theirs or one running) raises NotImplementedError
        for the caller: they wait."""
        lengths = [job.row.prompt_len for job in jobs]
        fitting = [lane for lane in self.lanes if lane.jobs and fits(lane.lengths() + lengths)]
        lane = max(fitting, key=lambda lane: len(lane.jobs), default=None)
        if lane is None:
            if self.lanes:  # what cannot share a batch does not run beside other lanes either: it waits
                running = self.lanes[0].run
                check_batchable(running, [running.rows[b] for b in running.active] + [job.row for job in jobs])
            lane = Lane()
            lane.join(jobs, self.target, self.allocator, self.max_rows)  # raises before the lane is kept
            self.lanes.append(lane)
            return
        lane.join(jobs, self.target, self.allocator, self.max_rows)
