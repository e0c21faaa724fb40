"""Run methods over prompts, interleaved, and record every run.

For each repeat and prompt, every method runs once, in an order rotated from prompt to prompt, so
machine drift and order effects fall on all methods alike. One short warm-up per method comes first,
then one untimed run per method that counts its host syncs and device ops (`host_costs`). What the train-free
sources learn online, each method learns from its own timed runs only (`learning_apart`).
At temperature 0 every run's tokens are compared with `ar`'s on the same prompt and repeat.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from ..counters import StepCounter
from ..parallel import sharded
from ..step.cache import context_window, static_capacity
from ..step.drafters.estimates import kept_apart
from .methods import MethodSpec, Run, RunFn, Settings, find_method, method_delta
from .prompts import Prompt

WARMUP_TOKENS = 16
COUNTED_TOKENS = 64


@dataclass(frozen=True)
class Case:
    """A prompt ready to run: its ids (1, T)."""

    prompt: Prompt
    ids: torch.Tensor


def prepare(prompts: list[Prompt], encode: Callable[[Prompt], torch.Tensor], target, max_new_tokens: int,
            ) -> tuple[list[Case], list[dict]]:
    """Tokenize prompts; set aside those whose prompt + max_new_tokens exceeds the target's context."""
    window = context_window(target)
    cases, skipped = [], []
    for prompt in prompts:
        ids = encode(prompt)
        if window is not None and ids.shape[1] + max_new_tokens > window:
            skipped.append({"prompt_id": prompt.id, "category": prompt.category, "prompt_tokens": ids.shape[1],
                            "reason": f"prompt + max_new_tokens = {ids.shape[1] + max_new_tokens} > context {window}"})
        else:
            cases.append(Case(prompt, ids.to(target.device)))
    return cases, skipped


def build_runners(target, draft, specs: list[MethodSpec], settings: Settings) -> dict[str, RunFn]:
    """Each method's run function, learning apart (`learning_apart`)."""
    missing = [s.name for s in specs if find_method(s.name).needs_draft and draft is None]
    if missing:
        raise ValueError(f"method(s) {sorted(set(missing))} need a draft model (--draft)")
    return learning_apart(target, {s.label: find_method(s.name).make(target, draft, settings, s) for s in specs})


def learning_apart(target, runners: dict[str, RunFn]) -> dict[str, RunFn]:
    """The runners, each with a state of its own for what the train-free sources learn online (Token Recycling's
    matrix, lookup's hit rates: `estimates.kept_apart`): a method learns from its own earlier runs only, never
    from another method's run (or a warm-up) of the prompt it is about to run."""
    def apart(run: RunFn) -> RunFn:
        states: dict = {}

        def kept(prompt_ids):
            with kept_apart(target, states):
                return run(prompt_ids)
        return kept
    return {label: apart(run) for label, run in runners.items()}


def run_bench(target, draft, cases: list[Case], specs: list[MethodSpec], settings: Settings, repeats: int = 1,
              progress: bool = True, batch: int = 1) -> list[dict]:
    """Every method on every case, `repeats` times, interleaved. Returns the raw records. With `batch`
    B > 1, every method runs each group of B cases twice, interleaved: one after another (its label), and
    as one batch (label `METHOD xB`, each row's time an equal share of the batch's)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if batch < 1:
        raise ValueError(f"--batch must be >= 1, got {batch}")
    if batch > 1:
        return run_batched(target, draft, cases, specs, settings, repeats, progress, batch)
    if not cases:
        raise ValueError("no prompts to run (all filtered out or too long for the target's context)")
    assert specs[0].name == "ar", "ar runs first in the spec list: it is the baseline"
    runners = build_runners(target, draft, specs, settings)
    warmup_s = warm_up(target, draft, specs, settings, cases)
    # a target sharded over ranks (--tp) is not counted: the op counter does not see through its DTensors
    costs = {s.label: {} for s in specs} if sharded(target) else host_costs(target, draft, specs, settings, cases[0].ids)
    for label, seconds in warmup_s.items():
        costs[label]["warmup_s"] = seconds
    records = []
    bar = tqdm(total=repeats * len(cases) * len(specs), desc="bench", unit="run", disable=not progress)
    for repeat in range(repeats):
        for i, case in enumerate(cases):
            shift = (i + repeat) % len(specs)
            runs = {}
            for spec in specs[shift:] + specs[:shift]:
                bar.set_postfix_str(f"{case.prompt.id} {spec.label}", refresh=False)
                runs[spec.label] = runners[spec.label](case.ids)
                bar.update()
            reference = runs[specs[0].label].token_ids if settings.temperature == 0 else None
            records += [{**record(case, spec, settings, repeat, runs[spec.label], reference), **costs[spec.label]}
                        for spec in specs]
    bar.close()
    return records


def run_batched(target, draft, cases: list[Case], specs: list[MethodSpec], settings: Settings, repeats: int,
                progress: bool, batch: int) -> list[dict]:
    """`run_bench` with B > 1: per group of B cases, each method one prompt after another and as one batch
    (method and label `... xB`). A last group of fewer cases runs as a smaller batch."""
    runners = build_runners(target, draft, specs, settings)  # one after another
    batched = build_runners(target, draft, specs, settings)  # as one batch: learning apart from the runs alone
    warm_up(target, draft, specs, settings, cases)
    for runner in build_runners(target, draft, specs, settings).values():  # the batch path warms up too, and
        # refuses here, not half-way; at the batch's size, so that what is timed once per machine for it (the
        # batch latency table) is not timed here
        runner([case.ids[:, :WARMUP_TOKENS] for case in cases[:max(batch, 2)]])
    groups = [cases[i : i + batch] for i in range(0, len(cases), batch)]
    records = []
    bar = tqdm(total=repeats * len(groups) * len(specs) * 2, desc=f"bench (batch {batch})", unit="run",
               disable=not progress)
    for repeat in range(repeats):
        for g, group in enumerate(groups):
            shift = (g + repeat) % len(specs)
            alone, together = {}, {}
            for spec in specs[shift:] + specs[:shift]:
                bar.set_postfix_str(f"group {g} {spec.label}", refresh=False)
                alone[spec.label] = [runners[spec.label](case.ids) for case in group]
                bar.update()
                together[spec.label] = batched[spec.label]([case.ids for case in group])
                bar.update()
            reference = alone[specs[0].label] if settings.temperature == 0 else None
            for spec in specs:
                for i, case in enumerate(group):
                    ref = None if reference is None else reference[i].token_ids
                    records.append(dict(record(case, spec, settings, repeat, alone[spec.label][i], ref), batch=1))
                    row = record(case, spec, settings, repeat, together[spec.label][i], ref)
                    records.append(dict(row, method=f"{spec.name} x{len(group)}", label=f"{spec.label} x{len(group)}",
                                        batch=len(group)))
    bar.close()
    return records


def warm_up(target, draft, specs: list[MethodSpec], settings: Settings, cases: list[Case]) -> dict[str, float]:
    """Short untimed runs per method, on the first prompt and on its first half (allocations, lazy inits,
    caches of the kernels; a compiled method compiles here, its dynamic-shape graph included), then on
    one prompt per static-cache capacity bucket the timed runs will use: a compiled fixed-shape step
    (opttree's `--compile`, hf-compiled) compiles once per bucket, and that belongs here, not in a timed
    run. Returns each method's warm-up seconds."""
    short = Settings(**{**asdict(settings), "max_new_tokens": min(WARMUP_TOKENS, settings.max_new_tokens)})
    ids = cases[0].ids
    limit = context_window(target)
    seconds = {}
    for spec, (label, runner) in zip(specs, build_runners(target, draft, specs, short).items()):
        # the buckets of the timed runs: a static-path step spans the generation and its tree, padded to the
        # budget (`engine.static_rows`; measured: without the tree, budget 64 compiled in a timed run)
        width = spec.budget or 0
        buckets = sorted({static_capacity(case.ids.shape[1] + settings.max_new_tokens + width, limit) for case in cases})
        # a prompt just past half a bucket lands in that bucket with the warm-up's few new tokens and any tree
        in_buckets = [ids.repeat(1, bucket // ids.shape[1] + 1)[:, : bucket // 2 + 1] for bucket in buckets]
        start = time.perf_counter()
        for prompt in [ids, ids[:, : max(ids.shape[1] // 2, 1)], *in_buckets]:
            runner(prompt)
        if find_method(spec.name).warm_every_length:  # from a few tokens to the end of each bucket
            seed = ids[:, :WARMUP_TOKENS]
            for bucket in buckets:
                through = Settings(**{**asdict(settings), "max_new_tokens": bucket - seed.shape[1]})
                find_method(spec.name).make(target, draft, through, spec)(seed)
        seconds[label] = time.perf_counter() - start
    return seconds


def host_costs(target, draft, specs: list[MethodSpec], settings: Settings, ids: torch.Tensor) -> dict[str, dict]:
    """Per method, from one untimed run on the first prompt (at most COUNTED_TOKENS tokens, prefill
    included) under `opttree.counters.StepCounter`: host syncs, shape syncs and dispatched ops per step
    (per token for a peer whose steps are not observable)."""
    short = Settings(**{**asdict(settings), "max_new_tokens": min(COUNTED_TOKENS, settings.max_new_tokens)})
    costs = {}
    for label, runner in build_runners(target, draft, specs, short).items():
        with StepCounter() as counter:
            run = runner(ids)
        per = max(run.steps or len(run.token_ids), 1)
        costs[label] = {"host_syncs_per_step": counter.host_syncs / per, "shape_syncs_per_step": counter.shape_syncs / per,
                        "ops_per_step": counter.ops / per}
    return costs


def record(case: Case, spec: MethodSpec, settings: Settings, repeat: int, run: Run, reference: list[int] | None
           ) -> dict:
    """One raw figure of results.json."""
    n = len(run.token_ids)
    diff = None if reference is None else first_difference(run.token_ids, reference)
    return {
        "prompt_id": case.prompt.id,
        "category": case.prompt.category,
        "method": spec.name,
        "budget": spec.budget,
        "delta": None if spec.budget is None else method_delta(spec, settings),
        "label": spec.label,
        "repeat": repeat,
        "prompt_tokens": case.ids.shape[1],
        "new_tokens": n,
        "steps": run.steps,
        "mean_accepted_length": n / run.steps if run.steps else None,
        "accepted_histogram": run.accepted_histogram,
        "time_s": run.time_s,
        "draft_s": run.draft_s,  # opttree methods: drafting (every source) and verification time
        "verify_s": run.verify_s,
        "row_budget": run.row_budget,
        "tokens_per_second": n / run.time_s if run.time_s > 0 else None,
        "mismatch": None if reference is None else diff is not None,  # None: not checked (temperature > 0)
        "first_mismatch": diff,  # index of the first new token that differs from ar's
        "token_ids": run.token_ids,
    }


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first position where the two sequences differ (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))
