"""Several rows of a batch draft together: each row's tree policy runs in a thread of its own, and the
draft-model forwards the rows ask for in the same round run as one batched forward.

A drafter declares `forwards_together = True` when its forwards may be batched with other rows' (a
`ModelDrafter`: its `root` and `expand` hand them to the open `Round`). A round waits until every
row's thread is either waiting for a forward or done, then runs the waiting forwards, one per draft
model: the rows' caches stacked (`opttree.step.cache.stack_rows`, each padded at its end), each row's new
tokens under its own mask (its cache and its own new tokens, as its forward alone would see them), and
each row's new keys and values appended to its own cache. Rows are batched in row order, and a row's
forward reads nothing of the others, so its tree does not depend on what else is in the batch.

One forward of B x K tokens costs about what one of K does where a forward is overhead-bound (a small
draft on a CPU, any draft on a GPU), so B rows draft in about the time of one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from ...threads import single_threaded_ops
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
    runner: Callable | None = None  # what runs the model (the drafter's `draft_forward`), None: `masked_forward`'s
    logits: torch.Tensor | None = field(default=None, repr=False)


def current_round() -> "Round | None":
    """The round the calling thread drafts in (None outside one: forwards run at once)."""
    return getattr(_here, "round", None)


class Round:
    """One step's drafting of several rows (`run`); drafters hand their forwards to it (`submit`)."""

    def __init__(self):
        self.lock = threading.Condition()
        self.waiting: list[_Forward] = []
        self.done = 0  # rows whose tree is built (or whose drafting failed)

    def run(self, builds: list[Callable[[], object]]) -> list:
        """Each build in a thread of its own; returns their results in order (the first error is raised)."""
        results, errors = [None] * len(builds), [None] * len(builds)
        threads = [threading.Thread(target=self._row, args=(i, build, results, errors), daemon=True)
                   for i, build in enumerate(builds)]
        for thread in threads:
            thread.start()
        with self.lock:
            while True:
                self.lock.wait_for(lambda: len(self.waiting) + self.done == len(builds))
                if not self.waiting:
                    break
                forwards, self.waiting = sorted(self.waiting, key=lambda f: f.row), []
                try:
                    for model in {id(f.model): f.model for f in forwards}.values():
                        forward_together([f for f in forwards if f.model is model])
                except BaseException as error:  # noqa: BLE001 - the rows waiting for it fail with it
                    for f in forwards:
                        f.logits = error
                self.lock.notify_all()
        for thread in threads:
            thread.join()
        failed = next((error for error in errors if error is not None), None)
        if failed is not None:
            raise failed
        return results

    def _row(self, index: int, build: Callable[[], object], results: list, errors: list) -> None:
        _here.round, _here.row = self, index
        single_threaded_ops()  # a row's own ops are small; a team per row thread would slow every op (CPU)
        try:
            with torch.inference_mode():
                results[index] = build()
        except BaseException as error:  # noqa: BLE001 - raised again by `run`, in the caller's thread
            errors[index] = error
        finally:
            _here.round = None
            with self.lock:
                self.done += 1
                self.lock.notify_all()

    def submit(self, model, cache, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None,
               keys: Callable[[], torch.Tensor] | None = None, runner: Callable | None = None) -> torch.Tensor:
        """The row's forward, batched with the other rows' waiting forwards: logits (Q, V); the row's cache gains
        the Q new keys and values, as `masked_forward` would have appended them. `runner`: what runs `model` (the
        drafter's own forward, `draft_forward`; looking it up again costs ~0.2 ms a call on a CPU)."""
        forward = _Forward(_here.row, model, cache, tokens, positions, allowed, keys, runner)
        with self.lock:
            self.waiting.append(forward)
            self.lock.notify_all()
            self.lock.wait_for(lambda: forward.logits is not None)
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
    runner = next((f.runner for f in forwards if f.runner is not None), None)  # the model's: one for every row
    logits = masked_forward(model, stacked, tokens, positions, allowed, forward=runner, keys=lambda: keys)  # (B, Q, V)
    for b, (f, size) in enumerate(zip(forwards, sizes)):
        for i, layer in enumerate(stacked.layers):
            if layer.keys is not None and layer.keys.numel():
                new = slice(longest, longest + size)
                f.cache.update(layer.keys[b:b + 1, :, new], layer.values[b:b + 1, :, new], i)
        f.logits = logits[b, :size]
