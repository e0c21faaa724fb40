"""Several rows of a batch draft together: each row's tree policy runs in a thread of its own, and the
draft-model forwards the rows ask for in the same round run as one batched forward.

A drafter declares `forwards_together = True` when its forwards may be batched with other rows' (a
`ModelDrafter`: its `root` and `expand` hand them to the open `Round`). The rows run one at a time,
each until it waits for a forward or is done; then the round runs the waiting forwards, one per draft
model: the rows' caches stacked (`opttree.cache.stack_rows`, each padded at its end), each row's new
tokens under its own mask (its cache and its own new tokens, as its forward alone would see them), and
each row's new keys and values appended to its own cache. Rows are batched in row order, and a row's
forward reads nothing of the others, so its tree does not depend on what else is in the batch.

One forward of B x K tokens costs about what one of K does where a forward is overhead-bound (a small
draft on a CPU, any draft on a GPU), so B rows draft in about the time of one.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..cache import cache_len, stack_rows
from ..verify import masked_forward

_here = threading.local()  # the round (and the row index) of a drafting thread


@dataclass
class _Forward:
    """One row's forward: tokens (Q,) at positions (Q,) after the row's cache of T keys; allowed (Q, T + Q)
    (None: causal), keys: the (T + Q,) key positions (None: 0..T-1, then the new tokens' positions)."""

    row: int
    model: torch.nn.Module
    cache: object
    tokens: torch.Tensor
    positions: torch.Tensor
    allowed: torch.Tensor | None
    keys: Callable[[], torch.Tensor] | None
    logits: torch.Tensor | BaseException | None = field(default=None, repr=False)
    ready: threading.Event = field(default_factory=threading.Event, repr=False)


def current_round() -> "Round | None":
    """The round the calling thread drafts in (None outside one: forwards run at once)."""
    return getattr(_here, "round", None)


class Round:
    """A batch's drafting, step after step (`run`); drafters hand their forwards to it (`submit`). Its
    threads are kept from one step to the next (a thread start costs about what a row's policy does)."""

    def __init__(self):
        self.pool: ThreadPoolExecutor | None = None
        self.threads = 0  # the pool's size: a batch's rows at most
        self.arrived = threading.Condition()
        self.waiting: list[_Forward] = []  # the forwards the rows wait for, in the order they asked
        self.running = 0  # 1 while a row runs, until it waits for a forward or ends

    def run(self, builds: list[Callable[[], object]]) -> list:
        """Each build in a thread of its own; returns their results in order (the first error is raised).
        One row runs at a time, until it waits for a forward or ends: rows running side by side would
        trade the interpreter lock at every torch call (measured: 3x the rows' own time)."""
        if self.pool is None or self.threads < len(builds):
            self.close()
            self.threads = max(len(builds), 2)
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="opttree-draft")
        futures = []
        for i, build in enumerate(builds):
            self._resume(lambda: futures.append(self.pool.submit(self._row, i, build)))
        while self.waiting:
            forwards, self.waiting = sorted(self.waiting, key=lambda f: f.row), []
            try:
                for model in {id(f.model): f.model for f in forwards}.values():
                    forward_together([f for f in forwards if f.model is model])
            except BaseException as error:  # noqa: BLE001 - the rows waiting for it fail with it
                for f in forwards:
                    f.logits = error
            for f in forwards:
                self._resume(f.ready.set)
        return [future.result() for future in futures]  # the first row's error is raised here

    def _resume(self, start: Callable[[], object]) -> None:
        """Start (or wake) one row and wait until it waits for a forward or ends."""
        with self.arrived:
            self.running = 1
            start()
            self.arrived.wait_for(lambda: self.running == 0)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)
            self.pool = None

    def _row(self, index: int, build: Callable[[], object]) -> object:
        _here.round, _here.row = self, index
        try:
            with torch.inference_mode():
                return build()
        finally:
            _here.round = None
            self._leave(None)

    def _leave(self, forward: _Forward | None) -> None:
        """The calling row stops running: it waits for `forward`, or (None) it is done."""
        with self.arrived:
            if forward is not None:
                self.waiting.append(forward)
            self.running = 0
            self.arrived.notify()

    def submit(self, model, cache, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None,
               keys: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """The row's forward, batched with the other rows' waiting forwards: logits (Q, V); the row's cache gains
        the Q new keys and values, as `masked_forward` would have appended them."""
        forward = _Forward(_here.row, model, cache, tokens, positions, allowed, keys)
        self._leave(forward)
        forward.ready.wait()
        if isinstance(forward.logits, BaseException):
            raise forward.logits
        return forward.logits


def forward_together(forwards: list[_Forward]) -> None:
    """One forward of `model` over every row's new tokens, on the rows' caches stacked; sets each row's
    logits (Q_b, V) and appends its new keys and values to its own cache."""
    model = forwards[0].model
    lengths = [cache_len(f.cache) for f in forwards]  # T_b
    sizes = [f.tokens.shape[0] for f in forwards]  # Q_b
    longest, width = max(lengths), max(sizes)
    device = forwards[0].tokens.device
    stacked = stack_rows([(f.cache, [length]) for f, length in zip(forwards, lengths)])
    tokens = torch.zeros(len(forwards), width, dtype=torch.long, device=device)  # (B, Q)
    positions = torch.zeros(len(forwards), width, dtype=torch.long, device=device)
    allowed = torch.zeros(len(forwards), width, longest + width, dtype=torch.bool, device=device)  # (B, Q, T + Q)
    keys = torch.zeros(len(forwards), longest + width, dtype=torch.long, device=device)  # (B, T + Q)
    pad = torch.arange(width, device=device)
    for b, (f, length, size) in enumerate(zip(forwards, lengths, sizes)):
        tokens[b, :size], positions[b, :size] = f.tokens, f.positions
        own = f.allowed if f.allowed is not None else torch.ones(size, length + size, dtype=torch.bool,
                                                                 device=device).tril(length)  # causal
        allowed[b, :size, :length], allowed[b, :size, longest:longest + size] = own[:, :length], own[:, length:]
        allowed[b, pad[size:], longest + pad[size:]] = True  # padding queries see themselves only
        row_keys = f.keys() if f.keys is not None else torch.cat([torch.arange(length, device=device), f.positions])
        keys[b, :length], keys[b, longest:longest + size] = row_keys[:length], row_keys[length:]
    logits = masked_forward(model, stacked, tokens, positions, allowed, keys=lambda: keys)  # (B, Q, V)
    for b, (f, size) in enumerate(zip(forwards, sizes)):
        for i, layer in enumerate(stacked.layers):
            if layer.keys is not None and layer.keys.numel():
                new = slice(longest, longest + size)
                f.cache.update(layer.keys[b:b + 1, :, new], layer.values[b:b + 1, :, new], i)
        f.logits = logits[b, :size]
