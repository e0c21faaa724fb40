"""Hardware-aware budget (docs/BENCH_USAGE.md, "opttree calibrate"): `opttree calibrate` and `--budget auto`.

0. Alignment of the pair: on text the target writes from the calibration prompts, the draft
   temperature that calibrates p-hat (`opttree.alignment.fit_draft_temperature`) and Sequoia's
   acceptance vector, each for greedy decoding and for sampling (at temperature 1).
1. Latency curves: target and draft forward time for k = 1..K new tokens after a ~200-token KV
   cache (a root and k - 1 children, the engine's masked forward), median of repeats.
2. A short calibration run: every (budget, delta) of a grid on a few prompts, with the draft at
   its calibrated temperature, interleaved with plain decoding, recording mean accepted length (MAL), tree size, draft layers and tokens/s.
3. Estimate, per grid point: tokens/s = new tokens / (steps * step time + prefill), with
   step time = T_target(nodes + 1) + T_draft(MAL) + layers * T_draft(width) + overhead.
   The forwards come from the latency curves; the overhead (sampling, tree building, caches,
   Python) is one constant per step, fitted as the median over the grid of measured minus modelled.
4. Recommend the grid point with the best estimate, confirmed by measurement: if its measured
   tokens/s falls below CONFIRM of the best measured one, the measured best is recommended.
5. Draft sources: at the recommended budget and delta, each of DRAFTERS (the draft model alone, with
   lookup, and the train-free recycling+lookup), and the train-free sources also at twice the budget
   (their extra nodes cost no draft forward, only verification), interleaved with plain decoding; the
   fastest measured (drafter and budget) is recommended, and plain decoding (`tree: ar`) when none
   beats it: never slower by default.
6. Sampling: the same choice at temperature SAMPLED_TEMPERATURE among `sampled_runs` (OPT-Tree with
   sampled children at two budgets, with lookup, DySpec, the train-free sources), with the draft at its
   sampled temperature, saved as SAMPLED_FIELD: what a sampled generation with the default settings runs.

The profile is saved as DIR/profile.json and in the user cache; `opttree.profiles` keys, finds and
reads it back (`auto_settings`, `profile_options`), and holds the shipped pair's profile.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..alignment import fit_draft_temperature, paired_logits, reliability
from ..cache import cache_argument, context_window, new_cache, truncate
from ..drafters import model_drafter
from ..speculator import _vocab_size, generate
from ..hardware import hardware_key
from ..policies import sequoia
from ..profiles import (  # noqa: F401 (also read as opttree.bench.calibrate.<name>)
    DRAFT_TEMPERATURE_FIELD, PROFILE_VERSION, SAMPLED_FIELD, SHIPPED_PROFILES, auto_settings, calibrated_options,
    find_profile, load_profile, measured_sources, profile_dir, profile_draft_temperature, profile_key, profile_options, profile_path, save_profile,
)
from ..tree import position_ids, tree_attention_mask
from ..verify import masked_forward
from .methods import seconds_since
from .report import machine_info, now

ALIGNMENT_WIDTH = 8  # ranks in Sequoia's acceptance vector
RELIABILITY_FIELD = "draft_reliability"  # {"raw": rows, "calibrated": rows} of alignment.reliability
CONFIRM = 0.9  # the estimate's choice must reach this fraction of the best measured tokens/s
NOISE_REPEATS = 9  # 1-token target forwards timed before and after the calibration run
NOISE_SHIFT = 1.5  # medians before / after differ by more than this factor: the load changed
NOISE_SPREAD = 0.5  # interquartile range / median of one batch above this: the timings are unsteady
AGREEMENT = 1.5  # estimated / measured tokens/s outside [1/1.5, 1.5] (median over the grid): warn
DRAFTERS = ("model", "model+lookup", "recycling+lookup")  # the draft sources step 5 compares
SAMPLED_TEMPERATURE = 1.0  # step 6 measures sampling at this temperature (OpenAI's and the server's default)
DEFAULT_BUDGETS = (2, 4, 6, 8, 10, 12, 16, 24, 32)
DEFAULT_DELTAS = (0.1, 0.3, 0.45, 0.6)
CALIBRATION_PROMPTS = [  # code to continue: the shipped pair's domain; pass --prompts for your own workload
    "def binary_search(items, target):\n    \"\"\"Return the index of target in the sorted list items, or -1.\"\"\"\n",
    "import json\nimport os\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return it as a dict.\"\"\"\n",
    "class LRUCache:\n    \"\"\"A least-recently-used cache with a fixed capacity.\"\"\"\n\n    def __init__(self, capacity):\n",
    "def parse_args(argv=None):\n    import argparse\n\n    parser = argparse.ArgumentParser(description=\"Copy files.\")\n",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n    result = []\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n",
    "def word_counts(text):\n    \"\"\"Count how often each word occurs in text.\"\"\"\n    counts = {}\n",
    "import re\n\n\ndef is_valid_email(address):\n",
]


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
    caches = {name: new_cache() for name in models}
    contexts = {name: context.to(model.device) for name, model in models.items()}
    times: dict[str, list[list[float]]] = {name: [[] for _ in range(max_tokens)] for name in models}
    with torch.inference_mode():
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


# ---- 2. the calibration run ----------------------------------------------------------------------


class CountingDrafter:
    """A drafter that counts its tree layers (expand calls) and their widths, for the cost model."""

    def __init__(self, inner):
        self.inner = inner
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
    """(drafter, budget) pairs step 5 measures: every one of DRAFTERS at `budget`, the train-free ones
    also at twice it (up to `max_budget`)."""
    wide = min(2 * budget, max_budget)
    return [(name, budget) for name in DRAFTERS] + \
           [(name, wide) for name in DRAFTERS if "model" not in name and wide > budget]


def sampled_runs(budget: int) -> list[tuple[str, int, str]]:
    """(drafter, budget, tree) runs step 6 measures around the greedy choice's budget."""
    half = max(2, budget // 2)
    return [("model", half, "opt"), ("model", budget, "opt"), ("model+lookup", budget, "opt"),
            ("model", budget, "dyspec"), ("recycling+lookup", budget, "opt")]


def drafter_run(target, draft, prompts: list[torch.Tensor], runs: list[tuple], delta: float,
                options: dict, progress: bool = True, draft_temperature: float = 1.0) -> list[dict]:
    """Plain decoding and OPT-Tree (or the tree policy a run names third) over each (drafter, budget[, tree])
    of `runs` at `delta`, interleaved per prompt. Returns one row per run: mean accepted length, measured
    tokens/s and speedup over plain decoding."""
    keys = [None, *runs]
    tallies = {key: Tally(None, None) if key is None else Tally(key[1], delta) for key in keys}
    bar = tqdm(total=len(prompts) * len(keys), desc="draft sources", unit="run", disable=not progress)
    for i, ids in enumerate(prompts):
        shift = i % len(keys)
        for key in keys[shift:] + keys[:shift]:
            with_model = key is not None and "model" in key[0]
            if key is None:
                run = dict(tree="ar")
            else:
                run = dict(tree=key[2] if len(key) > 2 else "opt", drafter=key[0], budget=key[1], delta=delta,
                           draft_temperature=draft_temperature if with_model else 1.0)
            start = time.perf_counter()
            out = generate(target, ids, draft if with_model else None, **run, **options)
            tally = tallies[key]
            tally.time_s += seconds_since(start, target)
            tally.new_tokens += out.stats.new_tokens
            tally.steps += out.stats.steps
            bar.update()
    bar.close()
    plain = tallies[None].measured_tps
    return [{"tree": key[2] if len(key) > 2 else "opt", "drafter": key[0], "budget": key[1],
             "mean_accepted_length": t.new_tokens / t.steps,
             "measured_tokens_per_second": t.measured_tps, "measured_speedup": t.measured_tps / plain}
            for key, t in tallies.items() if key]


def recommend_drafter(rows: list[dict]) -> dict:
    """The fastest measured draft sources and their budget, or plain decoding (tree 'ar') when none beats it."""
    best = max(rows, key=lambda r: r["measured_tokens_per_second"])
    if best["measured_speedup"] < 1:
        return {"tree": "ar", "drafter": None, "drafter_budget": None, "measured_speedup": 1.0,
                "why": f"no draft source beat plain decoding (best: {best['drafter']} at {best['measured_speedup']:.2f}x)"}
    return {"tree": best.get("tree", "opt"), "drafter": best["drafter"], "drafter_budget": best.get("budget"),
            "measured_speedup": best["measured_speedup"],
            "why": f"the fastest measured ({best['measured_speedup']:.2f}x plain decoding)"}


def probe_ms(model, context: torch.Tensor, repeats: int = NOISE_REPEATS) -> list[float]:
    """ms of `repeats` one-token forwards after `context` (C,) is cached: the noise probe's samples."""
    cache = new_cache()
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


# ---- 3. the estimate -----------------------------------------------------------------------------


def at(curve: list[float], k: float) -> float:
    """T(k) from a latency curve (entry k - 1), k rounded and clamped to the measured range."""
    return curve[min(max(round(k), 1), len(curve)) - 1]


def forward_seconds_per_step(tally: Tally, t_target: list[float], t_draft: list[float]) -> float:
    """Modelled forward time of one step: T_target(nodes + 1) + T_draft(MAL) + layers * T_draft(width)."""
    steps = tally.steps
    width = tally.layer_tokens / tally.layers if tally.layers else 1
    return (at(t_target, tally.drafted / steps + 1) + at(t_draft, tally.new_tokens / steps)
            + tally.layers / steps * at(t_draft, width))


def fitted_overhead(grid: list[Tally], t_target: list[float], t_draft: list[float]) -> float:
    """Seconds per step outside the forwards: median over the grid of measured minus modelled, >= 0."""
    gaps = [(t.time_s - t.prefill_s) / t.steps - forward_seconds_per_step(t, t_target, t_draft) for t in grid]
    return max(statistics.median(gaps), 0.0)


def estimated_tps(tally: Tally, t_target: list[float], t_draft: list[float], overhead: float) -> float:
    """Estimated tokens/s (docs/BENCH_USAGE.md, "An estimate"): new tokens / (steps * (modelled
    forwards + overhead) + prefill)."""
    step_s = forward_seconds_per_step(tally, t_target, t_draft) + overhead
    return tally.new_tokens / (tally.steps * step_s + tally.prefill_s)


def grid_rows(plain: Tally, grid: list[Tally], t_target: list[float], t_draft: list[float], overhead: float
              ) -> list[dict]:
    rows = []
    for tally in grid:
        rows.append({
            "budget": tally.budget,
            "delta": tally.delta,
            "mean_accepted_length": tally.new_tokens / tally.steps,
            "nodes_per_step": tally.drafted / tally.steps,
            "draft_layers_per_step": tally.layers / tally.steps,
            "estimated_tokens_per_second": estimated_tps(tally, t_target, t_draft, overhead),
            "measured_tokens_per_second": tally.measured_tps,
            "measured_speedup": tally.measured_tps / plain.measured_tps,
        })
    return rows


# ---- 4. the recommendation -----------------------------------------------------------------------


def recommend(rows: list[dict]) -> dict:
    """The best estimate, unless measurement disagrees by more than CONFIRM (then the measured best)."""
    by_estimate = max(rows, key=lambda r: r["estimated_tokens_per_second"])
    by_measure = max(rows, key=lambda r: r["measured_tokens_per_second"])
    confirmed = by_estimate["measured_tokens_per_second"] >= CONFIRM * by_measure["measured_tokens_per_second"]
    chosen = by_estimate if confirmed else by_measure
    return {
        "budget": chosen["budget"],
        "delta": chosen["delta"],
        "chosen_by": "estimate (confirmed by measurement)" if confirmed else "measurement (the estimate's choice "
        f"n={by_estimate['budget']}, delta={by_estimate['delta']} measured below {CONFIRM:.0%} of the best)",
        "estimated_tokens_per_second": chosen["estimated_tokens_per_second"],
        "measured_tokens_per_second": chosen["measured_tokens_per_second"],
        "best_measured": {k: by_measure[k] for k in ("budget", "delta", "measured_tokens_per_second")},
        "fraction_of_best_measured": chosen["measured_tokens_per_second"] / by_measure["measured_tokens_per_second"],
    }


# ---- the whole calibration -----------------------------------------------------------------------


def run_calibration(target, draft, prompts: list[torch.Tensor], budgets=DEFAULT_BUDGETS, deltas=DEFAULT_DELTAS,
              max_tokens: int = 64, context: int = 200, repeats: int = 7, max_new_tokens: int = 128,
              max_depth: int | None = None, temperature: float = 0.0, seed: int = 0, eos_token_id: int | None = None,
              progress: bool = True) -> dict:
    """Measure, estimate and recommend. Returns the profile (a JSON-able dict). Prompts: ids (1, T)."""
    if draft is None:
        raise ValueError("calibrate needs a draft model (--draft)")
    if not prompts:
        raise ValueError("calibrate needs at least one prompt")
    budgets, deltas = sorted(set(budgets)), sorted(set(deltas))
    if budgets[0] < 1 or budgets[-1] + 1 > max_tokens:
        raise ValueError(f"calibration budgets must be in [1, max_tokens - 1 = {max_tokens - 1}], got {budgets}; "
                         "raise --max-tokens or lower --budgets")
    window = min(w for w in (context_window(target), context_window(draft), 10**9) if w is not None)
    if context + max_tokens > window:
        raise ValueError(f"context {context} + max_tokens {max_tokens} exceeds the models' context window {window}")
    alignment = alignment_entry(target, draft, prompts, max_new_tokens, seed)
    draft_temperature = profile_draft_temperature(alignment, temperature)
    cached = context_ids(prompts, context)
    probe_before = probe_ms(target, cached)
    curves = latency_curves({"target": target, "draft": draft}, cached, max_tokens, repeats)
    t_target, t_draft = curves["target"], curves["draft"]
    options = dict(max_new_tokens=max_new_tokens, max_depth=max_depth, temperature=temperature, seed=seed,
                   eos_token_id=eos_token_id)
    plain, grid = calibration_run(target, draft, prompts, budgets, deltas, options, progress, draft_temperature)
    overhead = fitted_overhead(grid, t_target, t_draft)
    rows = grid_rows(plain, grid, t_target, t_draft, overhead)
    chosen = recommend(rows)
    sources = drafter_run(target, draft, prompts, drafter_runs(chosen["budget"], budgets[-1]), chosen["delta"],
                          options, progress, draft_temperature)
    sampled_temperature = profile_draft_temperature(alignment, SAMPLED_TEMPERATURE)
    sampled = drafter_run(target, draft, prompts, sampled_runs(chosen["budget"]), chosen["delta"],
                          dict(options, temperature=SAMPLED_TEMPERATURE), progress, sampled_temperature)
    probe_after = probe_ms(target, cached)
    return {
        "version": PROFILE_VERSION,
        "key": profile_key(target, draft),
        "date": now(),
        "machine": machine_info(),
        "hardware": hardware_key(target.device),
        "target": target.config._name_or_path,
        "draft": draft.config._name_or_path,
        "dtype": str(target.dtype).removeprefix("torch."),
        "settings": dict(options, prompts=len(prompts), context=context, repeats=repeats),
        "latency": {"k": list(range(1, max_tokens + 1)), "target_s": t_target, "draft_s": t_draft},
        "overhead_per_step_s": overhead,
        "estimate_over_measured": statistics.median(
            r["estimated_tokens_per_second"] / r["measured_tokens_per_second"] for r in rows),
        "ar_tokens_per_second": plain.measured_tps,
        "noise": {"probe_ms_before": probe_before, "probe_ms_after": probe_after,
                  "problem": noise_problem(probe_before, probe_after)},
        "grid": rows,
        "drafters": sources,
        "recommended": dict(chosen, draft_temperature=draft_temperature, **recommend_drafter(sources)),
        "drafters_sampled": sampled,
        SAMPLED_FIELD: dict(recommend_drafter(sampled), delta=chosen["delta"], temperature=SAMPLED_TEMPERATURE,
                            draft_temperature=sampled_temperature),
        **alignment,
    }


# ---- reports -------------------------------------------------------------------------------------


def latency_table(profile: dict) -> str:
    lat = profile["latency"]
    lines = ["| k (new tokens) | target ms | draft ms |", "|---:|---:|---:|"]
    lines += [f"| {k} | {1000 * t:.2f} | {1000 * d:.2f} |" for k, t, d in zip(lat["k"], lat["target_s"], lat["draft_s"])]
    return "\n".join(lines)


def reliability_table(profile: dict) -> str:
    """Stated top-1 probability vs how often the target agrees, before and after the draft temperature."""
    table = profile[RELIABILITY_FIELD]
    tau = profile[DRAFT_TEMPERATURE_FIELD]["greedy"]
    lines = [f"| draft's top probability | positions (raw) | stated | accepted | positions (/ {tau:.3g}) | stated | "
             "accepted |", "|---|---:|---:|---:|---:|---:|---:|"]

    def cells(row):
        if not row["positions"]:
            return "0 | | "
        return f"{row['positions']} | {row['stated']:.2f} | {row['accepted']:.2f}"

    for raw, calibrated in zip(table["raw"], table["calibrated"]):
        lines.append(f"| {raw['from']:.1f}-{raw['to']:.1f} | {cells(raw)} | {cells(calibrated)} |")
    return "\n".join(lines)


def grid_table(profile: dict) -> str:
    lines = ["| budget | delta | mean accepted length | nodes/step | draft layers/step | estimated tokens/s | "
             "measured tokens/s | measured speedup |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in profile["grid"]:
        lines.append(f"| {r['budget']} | {r['delta']:g} | {r['mean_accepted_length']:.2f} | {r['nodes_per_step']:.1f} | "
                     f"{r['draft_layers_per_step']:.2f} | {r['estimated_tokens_per_second']:.1f} | "
                     f"{r['measured_tokens_per_second']:.1f} | {r['measured_speedup']:.2f}x |")
    return "\n".join(lines)


def drafter_table(profile: dict, field: str = "drafters") -> str:
    lines = ["| tree | drafter | budget | mean accepted length | measured tokens/s | measured speedup |",
             "|---|---|---:|---:|---:|---:|"]
    for r in profile.get(field, []):
        lines.append(f"| {r.get('tree', 'opt')} | {r['drafter']} | {r.get('budget', profile['recommended']['budget'])} | "
                     f"{r['mean_accepted_length']:.2f} | {r['measured_tokens_per_second']:.1f} | "
                     f"{r['measured_speedup']:.2f}x |")
    return "\n".join(lines)


def markdown(profile: dict) -> str:
    rec, s = profile["recommended"], profile["settings"]
    best = rec["best_measured"]
    return "\n".join([
        "# opttree calibrate",
        "",
        f"- date {profile['date']}; machine: {profile['machine']['processor']}, {profile['machine']['cpu_count']} CPUs, "
        f"{profile['machine']['torch_threads']} torch threads",
        f"- target `{profile['target']}`, draft `{profile['draft']}`, dtype {profile['dtype']}",
        f"- calibration run: {s['prompts']} prompts x {s['max_new_tokens']} new tokens, temperature {s['temperature']}, "
        f"max depth {s['max_depth'] or 'auto'}; plain decoding {profile['ar_tokens_per_second']:.1f} tokens/s",
        f"- draft temperature (fitted on the target's continuations): greedy "
        f"{profile[DRAFT_TEMPERATURE_FIELD]['greedy']:.3g}, sampled {profile[DRAFT_TEMPERATURE_FIELD]['sampled']:.3g}",
        f"- **recommended: budget {rec['budget']}, delta {rec['delta']:g}** ({rec['chosen_by']}): estimated "
        f"{rec['estimated_tokens_per_second']:.1f} tokens/s, measured {rec['measured_tokens_per_second']:.1f}; "
        f"best measured: budget {best['budget']}, delta {best['delta']:g}, {best['measured_tokens_per_second']:.1f} "
        f"tokens/s ({rec['fraction_of_best_measured']:.0%} of it reached)",
        f"- **recommended draft sources: {rec.get('drafter') or 'none (plain decoding, --tree ar)'}** "
        f"({rec.get('why', 'not measured')})",
        *[note for note in (consistency_note(profile), no_gain_note(profile)) if note],
        "",
        "## Draft sources at the recommended budget and delta (train-free ones also at twice the budget)",
        "",
        drafter_table(profile),
        "",
        *sampled_section(profile),
        "## Is the draft's p-hat calibrated? (greedy, the draft's first choice)",
        "",
        reliability_table(profile),
        "",
        "## Forward latency after a cached context of " f"{s['context']} tokens (median of {s['repeats']})",
        "",
        latency_table(profile),
        "",
        "## Calibration grid",
        "",
        grid_table(profile),
        "",
    ])


def sampled_choice(chosen: dict) -> str:
    """Step 6's choice in words."""
    what = "plain decoding" if chosen["tree"] == "ar" else f"{chosen['tree']}:{chosen['drafter']} at budget " \
        f"{chosen['drafter_budget']}"
    return f"{what} ({chosen['why']})"


def sampled_section(profile: dict) -> list[str]:
    """The report's lines on step 6 (none for a profile without it)."""
    chosen = profile.get(SAMPLED_FIELD)
    if not chosen:
        return []
    return [f"## Sampling (temperature {chosen['temperature']:g}): {sampled_choice(chosen)}", "",
            drafter_table(profile, "drafters_sampled"), ""]


def consistency_note(profile: dict) -> str:
    """A warning when the latency model and the calibration run disagree (empty string otherwise)."""
    ratio = profile["estimate_over_measured"]
    if 1 / AGREEMENT <= ratio <= AGREEMENT:
        return ""
    return (f"- **the latency curves and the calibration run disagree** (estimated / measured tokens/s = {ratio:.2f}): "
            "the machine was probably busy during one of them; run `opttree calibrate` again on an idle machine")


def no_gain_note(profile: dict) -> str:
    """A warning when no calibrated setting beat plain decoding (empty string otherwise)."""
    best = profile["recommended"]["best_measured"]["measured_tokens_per_second"]
    if best >= profile["ar_tokens_per_second"]:
        return ""
    return (f"- **no budget beat plain decoding** ({best:.1f} vs {profile['ar_tokens_per_second']:.1f} tokens/s): "
            "on this machine the draft does not pay for itself; use --tree ar, or a cheaper or better-aligned draft")


def plot_latency(profile: dict, path: Path) -> Path:
    """latency.png: forward time vs new tokens, both models (the OPT-Tree paper's Figure 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lat, machine = profile["latency"], profile["machine"]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for role in ("target", "draft"):  # the models' folders, not their absolute paths
        name = "/".join(Path(profile[role]).parts[-2:])
        ax.plot(lat["k"], [1000 * t for t in lat[f"{role}_s"]], marker=".", label=f"{role} ({name})")
    where = machine.get("cuda") or f"{machine['processor']}, {machine['cpu_count']} CPUs"
    ax.set_title(f"Forward latency by tokens per forward\n{profile['dtype']}, median of "
                 f"{profile['settings']['repeats']} runs; {where}; {profile['date'][:10]}", fontsize=9)
    ax.set_xlabel(f"new tokens per forward (after {profile['settings']['context']} cached)")
    ax.set_ylabel("forward latency (ms, median)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(profile: dict, out_dir: Path, cache: bool = True) -> dict[str, Path]:
    """profile.json (also in the user cache if `cache`), calibration.md, latency.png in out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cache:
        cached, local = save_profile(profile, out_dir)
    else:  # a disturbed measurement: kept for inspection, never used by --budget auto
        cached, local = None, out_dir / "profile.json"
        local.write_text(json.dumps(profile, indent=1) + "\n")
    (out_dir / "calibration.md").write_text(markdown(profile))
    return {"profile": local, "cached_profile": cached, "markdown": out_dir / "calibration.md",
            "latency_plot": plot_latency(profile, out_dir / "latency.png")}


# ---- first use -----------------------------------------------------------------------------------

AUTO_ENV = "OPTTREE_AUTO_CALIBRATE"  # "0": never calibrate on first use
FIRST_USE = dict(prompts=3, max_tokens=17, repeats=3, max_new_tokens=48, budgets=(2, 4, 8, 12, 16),
                 deltas=(0.3, 0.6))  # the same as `opttree calibrate --quick`


def calibrate_on_first_use(target, draft, tokenizer, progress: bool = True) -> dict | None:
    """A quick calibration (FIRST_USE) of a pair that has no profile on this machine, saved to the user
    cache, with one message saying what it chose and why. None if `$OPTTREE_AUTO_CALIBRATE` is 0, the
    pair already has a profile, there is no draft (the train-free sources need no calibration), or the
    machine looked disturbed during the measurement (then nothing is saved). A profile that lacks the draft
    sources' measurements (`measured_sources`: an older one, or the shipped one) counts as none."""
    if draft is None or os.environ.get(AUTO_ENV, "1") == "0":
        return None
    found = find_profile(target, draft)
    if found is not None and measured_sources(json.loads(found.read_text())):
        return None
    why = ("the calibration profile of this pair here predates the draft sources' measurements" if found else
           "no calibration profile for this pair on this machine")
    print(f"opttree: {why}: a quick one first (about a minute at most; {AUTO_ENV}=0 skips it, `opttree calibrate` "
          "runs the full one)", file=sys.stderr)
    prompts = [tokenizer(p, return_tensors="pt", add_special_tokens=False).input_ids
               for p in CALIBRATION_PROMPTS[: FIRST_USE["prompts"]]]
    profile = run_calibration(target, draft, prompts, budgets=FIRST_USE["budgets"], deltas=FIRST_USE["deltas"],
                              max_tokens=FIRST_USE["max_tokens"], repeats=FIRST_USE["repeats"],
                              max_new_tokens=FIRST_USE["max_new_tokens"], eos_token_id=tokenizer.eos_token_id,
                              progress=progress)
    rec, problem = profile["recommended"], profile["noise"]["problem"]
    if problem:  # measured on a busy machine: not kept, the defaults apply
        print(f"opttree: the machine looked disturbed ({problem}): calibration not saved, the defaults apply; "
              "run `opttree calibrate` on a quieter machine", file=sys.stderr)
        return None
    save_profile(profile)
    print(f"opttree: calibrated in {profile_dir()}: draft sources {rec['drafter'] or 'none: plain decoding'} "
          f"({rec['why']}), budget {rec.get('drafter_budget') or rec['budget']}, delta {rec['delta']:g}, draft temperature "
          f"{rec['draft_temperature']:.3g}; plain decoding measured {profile['ar_tokens_per_second']:.1f} tokens/s; "
          f"when sampling: {sampled_choice(profile[SAMPLED_FIELD])}", file=sys.stderr)
    return profile


def calibrate_first(args, target, draft, tokenizer) -> None:
    """For generate, demo and serve: a pair run with the default settings (no --budget, --tree or
    --drafter) and no profile on this machine is calibrated first (`calibrate_on_first_use`)."""
    if args.tp:  # timings differ between ranks: a sharded pair takes the profile it has
        return
    if args.budget is None and args.tree is None and args.drafter is None:
        calibrate_on_first_use(target, draft, tokenizer, progress=sys.stderr.isatty())
