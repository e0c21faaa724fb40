"""Calibration steps 0-2, 5 and 6 (`opttree.calibration`): the pair's alignment, the forwards' latency
curves, the runs of every setting interleaved with plain decoding, and the noise probe around them."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..alignment import fit_draft_temperature, paired_logits, reliability
from ..device import seconds_since
from ..packed import packed_models
from ..profiles import DRAFT_TEMPERATURE_FIELD
from ..settings.config import DEFAULT_BUDGET, drafter_delta
from ..settings.declared import Declared
from ..settings.drafter_spec import DrafterSpec
from ..speculator import _vocab_size, generate
from ..step.cache import cache_argument, new_cache, truncate
from ..step.drafters import model_drafter
from ..step.drafters.estimates import kept_apart
from ..step.policies import sequoia
from ..step.tree import position_ids, tree_attention_mask
from ..step.verify import masked_forward

ALIGNMENT_WIDTH = 8  # ranks in Sequoia's acceptance vector
RELIABILITY_FIELD = "draft_reliability"  # {"raw": rows, "calibrated": rows} of alignment.reliability
NOISE_REPEATS = 9  # 1-token target forwards timed before and after the calibration run
NOISE_SHIFT = 1.5  # medians before / after differ by more than this factor: the load changed
NOISE_SPREAD = 0.5  # interquartile range / median of one batch above this: the timings are unsteady
DRAFTERS = ("model", "model+lookup", "recycling+lookup")  # the draft sources step 5 compares


# ---- 0. alignment ---------------------------------------------------------------------------------


def alignment_entry(target, draft, prompts: list[torch.Tensor], new_tokens: int, seed: int = 0) -> dict:
    """The profile fields that describe the pair rather than the machine: the draft temperature and
    Sequoia's acceptance vector (at that temperature), for greedy decoding and for sampling at T=1,
    and the greedy reliability of the draft's first choice before and after the temperature."""
    temperatures, vectors = {}, {}
    for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        pairs = list(paired_logits(target, draft, prompts, temperature, new_tokens=new_tokens, seed=seed))
        temperatures[mode] = fit_draft_temperature(pairs, temperature)
        vectors[mode] = sequoia.acceptance_vector(pairs, ALIGNMENT_WIDTH, temperature, seed=seed,
                                                  draft_temperature=temperatures[mode])
        if mode == "greedy":
            table = {"raw": reliability(pairs), "calibrated": reliability(pairs, temperatures[mode])}
    return {DRAFT_TEMPERATURE_FIELD: temperatures, sequoia.PROFILE_FIELD: vectors, RELIABILITY_FIELD: table}


# ---- 1. latency curves ---------------------------------------------------------------------------


def latency_curves(models: dict, context: torch.Tensor, max_tokens: int, repeats: int = 7) -> dict[str, list[float]]:
    """Median seconds of one forward over k = 1..max_tokens new tokens after `context` (C,) is cached.

    models: {name: model}. Returns {name: curve}, curve[k - 1] = T(k). Within each repeat, every k
    runs on every model back to back, so a busy spell of the machine hits them alike.
    """
    if max_tokens < 1 or repeats < 1:
        raise ValueError(f"max_tokens and repeats must be >= 1, got {max_tokens}, {repeats}")
    caches = {name: new_cache(model) for name, model in models.items()}
    contexts = {name: context.to(model.device) for name, model in models.items()}
    times: dict[str, list[list[float]]] = {name: [[] for _ in range(max_tokens)] for name in models}
    with torch.inference_mode(), packed_models(*models.values()):  # as a generation runs them
        for name, model in models.items():
            ids = contexts[name]
            model(input_ids=ids[None], position_ids=torch.arange(ids.shape[0], device=ids.device)[None],
                  **{cache_argument(model): caches[name]})
            forward_seconds(model, caches[name], ids, max_tokens)  # warm-up at the largest size
        for _ in range(repeats):
            for k in range(1, max_tokens + 1):
                for name, model in models.items():
                    times[name][k - 1].append(forward_seconds(model, caches[name], contexts[name], k))
    return {name: [statistics.median(samples) for samples in per_k] for name, per_k in times.items()}


def forward_seconds(model, cache, context: torch.Tensor, k: int) -> float:
    """One masked forward of a root and k - 1 children after the cached context, then drop them."""
    prefix_len, device = context.shape[0], context.device
    parents = torch.full((k - 1,), -1, dtype=torch.long, device=device)  # (k-1,) every node a child of the root
    tokens = context[torch.arange(k, device=device) % prefix_len]  # (k,) any in-vocabulary ids
    allowed = tree_attention_mask(parents, prefix_len)  # (k, P + k)
    positions = position_ids(torch.ones_like(parents), prefix_len)  # (k,)
    start = time.perf_counter()
    masked_forward(model, cache, tokens, positions, allowed)
    elapsed = seconds_since(start, model)
    truncate(cache, prefix_len)
    return elapsed


def context_ids(prompt_ids: list[torch.Tensor], length: int) -> torch.Tensor:
    """(length,) token ids: the calibration prompts concatenated and repeated, a realistic cache."""
    joined = torch.cat([ids.flatten() for ids in prompt_ids])
    return joined.repeat(length // joined.shape[0] + 1)[:length]


# ---- 2, 5, 6. the runs ----------------------------------------------------------------------


class CountingDrafter(Declared):
    """A drafter that counts its tree layers (expand calls) and their widths, for the cost model."""

    def __init__(self, inner):
        self.inner, self.networks = inner, inner.networks
        self.layers = 0
        self.layer_tokens = 0

    def start(self, input_ids):
        self.inner.start(input_ids)

    def root(self, committed):
        return self.inner.root(committed)

    def expand(self, tokens, parent_slots):
        self.layers += 1
        self.layer_tokens += tokens.shape[0]
        return self.inner.expand(tokens, parent_slots)

    def observe(self, result):
        self.inner.observe(result)


@dataclass
class Tally:
    """Totals of one setting over the calibration prompts."""

    budget: int | None  # None: plain decoding
    delta: float | None
    new_tokens: int = 0
    steps: int = 0
    drafted: int = 0  # draft nodes verified
    layers: int = 0  # drafter forwards over tree layers
    layer_tokens: int = 0
    prefill_s: float = 0.0
    time_s: float = 0.0

    @property
    def measured_tps(self) -> float:
        return self.new_tokens / self.time_s if self.time_s > 0 else 0.0


def calibration_run(target, draft, prompts: list[torch.Tensor], budgets, deltas, options: dict,
                    progress: bool = True, draft_temperature: float = 1.0) -> tuple[Tally, list[Tally]]:
    """Plain decoding and every (budget, delta) on every prompt, interleaved per prompt (rotated order)."""
    plain = Tally(None, None)
    grid = [Tally(b, d) for b in budgets for d in deltas]
    settings = [plain] + grid
    generate(target, prompts[0], draft, tree="opt", budget=budgets[0], delta=deltas[0],
             **{**options, "max_new_tokens": min(16, options["max_new_tokens"])})  # warm-up
    bar = tqdm(total=len(prompts) * len(settings), desc="calibrate", unit="run", disable=not progress)
    for i, ids in enumerate(prompts):
        shift = i % len(settings)
        for tally in settings[shift:] + settings[:shift]:
            drafter = CountingDrafter(model_drafter(draft, draft_temperature, vocab=_vocab_size(target)))
            tree = dict(tree="ar") if tally.budget is None else dict(tree="opt", budget=tally.budget, delta=tally.delta)
            start = time.perf_counter()
            out = generate(target, ids, drafter, **tree, **options)
            tally.time_s += seconds_since(start, target)
            tally.new_tokens += out.stats.new_tokens
            tally.steps += out.stats.steps
            tally.drafted += out.stats.drafted_tokens
            tally.prefill_s += out.stats.prefill_s
            tally.layers += drafter.layers
            tally.layer_tokens += drafter.layer_tokens
            bar.update()
    bar.close()
    return plain, grid


def drafter_runs(budget: int, max_budget: int) -> list[tuple[str, int]]:
    """(drafter, budget) pairs step 5 measures: the draft model's sources at `budget` (the draft model's choice),
    the train-free ones at it, twice it and the default budget (each at most `max_budget`): they draft a layer
    with no forward, so their best tree is wider and does not follow the draft model's (on an AVX2 CPU the draft
    model chose 4 nodes where recycling+lookup paid most at 16)."""
    free = sorted({min(b, max_budget) for b in (budget, 2 * budget, DEFAULT_BUDGET)})
    return [(name, budget) for name in DRAFTERS if "model" in name] + \
           [(name, b) for name in DRAFTERS if "model" not in name for b in free]


SMALLEST_SAMPLED = 2  # a sampled tree of 2 nodes (a chain of two draws, by draw rank) is measured too: on a CPU
# without bf16 hardware a float32 verify of 3 tokens costs 1.2x one, of 5 tokens 1.6x, and at T=1 it was the only
# tree that paid (2026-11-27, emulated AVX2: 1.28x plain decoding against 1.08x at budget 4)


SAMPLED_CHAIN = 3  # the chain step 6 measures: speculative sampling of 3 draws, verified as one block


def sampled_runs(budget: int) -> list[tuple[str, int, str]]:
    """(drafter, budget, tree) runs step 6 measures around the greedy choice's budget (half of it, it, and
    half as much again: sampled children are accepted less often than top-ranked ones, so the tree that pays
    can be wider), the smallest tree, and a chain of SAMPLED_CHAIN draws (on chat prompts, where the draft agrees
    with the target less, it beat the trees: docs/BENCHMARKS.md, "The draft's weights in int8"); each once (at
    budgets 1 and 2 some of these coincide)."""
    half = max(2, budget // 2)
    small = [("model", SMALLEST_SAMPLED, "opt")] if half > SMALLEST_SAMPLED else []
    runs = small + [("model", half, "opt"), ("model", budget, "opt"), ("model", budget + budget // 2, "opt"),
                    ("model", SAMPLED_CHAIN, "chain"), ("model+lookup", budget, "opt"), ("model", budget, "dyspec"),
                    ("recycling+lookup", budget, "opt")]
    return list(dict.fromkeys(runs))


def drafter_run(target, draft, prompts: list[torch.Tensor], runs: list[tuple], delta: float,
                options: dict, progress: bool = True, draft_temperature: float = 1.0) -> list[dict]:
    """Plain decoding and OPT-Tree (or the tree policy a run names third) over each (drafter, budget[, tree])
    of `runs` at `delta` (the draft model's; train-free sources at theirs, `config.drafter_delta`), interleaved
    per prompt. Returns one row per run: mean accepted length, measured tokens/s and speedup over plain
    decoding."""
    keys = [None, *runs]
    deltas = {key: drafter_delta(DrafterSpec.parse(key[0]), delta) for key in runs}
    tallies = {key: Tally(None, None) if key is None else Tally(key[1], deltas[key]) for key in keys}
    learnt: dict = {key: {} for key in keys}  # each run learns from its own earlier prompts only (`kept_apart`)
    bar = tqdm(total=len(prompts) * len(keys), desc="draft sources", unit="run", disable=not progress)
    for i, ids in enumerate(prompts):
        shift = i % len(keys)
        for key in keys[shift:] + keys[:shift]:
            with_model = key is not None and "model" in key[0]
            if key is None:
                run = dict(tree="ar")
            else:
                run = dict(tree=key[2] if len(key) > 2 else "opt", drafter=key[0], budget=key[1], delta=deltas[key],
                           draft_temperature=draft_temperature if with_model else 1.0)
            start = time.perf_counter()
            with kept_apart(target, learnt[key]):
                out = generate(target, ids, draft if with_model else None, **run, **options)
            tally = tallies[key]
            tally.time_s += seconds_since(start, target)
            tally.new_tokens += out.stats.new_tokens
            tally.steps += out.stats.steps
            bar.update()
    bar.close()
    plain = tallies[None].measured_tps
    return [{"tree": key[2] if len(key) > 2 else "opt", "drafter": key[0], "budget": key[1], "delta": deltas[key],
             "mean_accepted_length": t.new_tokens / t.steps,
             "measured_tokens_per_second": t.measured_tps, "measured_speedup": t.measured_tps / plain}
            for key, t in tallies.items() if key]


def probe_ms(model, context: torch.Tensor, repeats: int = NOISE_REPEATS) -> list[float]:
    """ms of `repeats` one-token forwards after `context` (C,) is cached: the noise probe's samples."""
    cache = new_cache(model)
    ids = context.to(model.device)
    with torch.inference_mode():
        model(input_ids=ids[None], position_ids=torch.arange(ids.shape[0], device=ids.device)[None],
              **{cache_argument(model): cache})
        return [1000 * forward_seconds(model, cache, ids, 1) for _ in range(repeats)]


def noise_problem(before: list[float], after: list[float], run: str = "the calibration run") -> str:
    """Why the machine looked disturbed during `run` ('' if it did not), from the same 1-token
    forward timed before and after it: a shifted median (the load changed) or a wide spread."""
    medians = [statistics.median(before), statistics.median(after)]
    if max(medians) > NOISE_SHIFT * min(medians):
        return (f"a 1-token target forward took {medians[0]:.2f} ms before {run} and "
                f"{medians[1]:.2f} ms after it (the machine's load changed)")
    for name, samples in (("before", before), ("after", after)):
        q1, _, q3 = statistics.quantiles(samples, n=4)
        if q3 - q1 > NOISE_SPREAD * statistics.median(samples):
            return (f"repeated 1-token target forwards {name} {run} spread {q1:.2f}-{q3:.2f} ms "
                    f"(interquartile) around {statistics.median(samples):.2f} ms")
    return ""
