"""The whole calibration (`opttree.calibration`): measure, estimate, recommend; and the first use of a pair
with no profile on this machine (a quick calibration before it runs)."""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from ..device import dtype_name
from ..hardware import hardware_key, machine_info, now
from ..profiles import (
    AUTO_ENV,
    PROFILE_VERSION,
    SAMPLED_FIELD,
    find_profile,
    measured_sources,
    profile_dir,
    profile_draft_temperature,
    profile_key,
    save_profile,
)
from ..settings.config import SOURCE_TOKENS
from ..step.cache import context_window
from ..step.policies import sequoia
from .estimate import fitted_overhead, grid_rows, recommend, recommend_drafter
from .measure import (
    alignment_entry,
    calibration_run,
    context_ids,
    drafter_run,
    drafter_runs,
    latency_curves,
    noise_problem,
    probe_ms,
    sampled_runs,
)
from .report import sampled_choice

SAMPLED_TEMPERATURE = 1.0  # step 6 measures sampling at this temperature (OpenAI's and the server's default)
# Raised when a step's costs change enough to move what the calibration chooses: a profile of this machine measured
# at an older revision is measured again on first use. 1: a layer's q, k, v and gate, up as one product each on
# CPUs with bf16 kernels (2026-11-28: wider trees cheaper; the greedy budget there moved from 8 to 16-24). 2: the draft
# sources compared over SOURCE_TOKENS-token generations (at 48 the quick one chose the draft model on an AVX2 CPU,
# 1.22x plain decoding on HumanEval, where recycling+lookup made 2.3-2.8x). 3: one sequence attends in float32 on CPUs
# whose bf16 attention is slow (plain decoding's step ~10 % cheaper there, tree steps 2-6 %).
STEP_REVISION = 3
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


# ---- the whole calibration -----------------------------------------------------------------------


def run_calibration(target, draft, prompts: list[torch.Tensor], budgets=DEFAULT_BUDGETS, deltas=DEFAULT_DELTAS,
              max_tokens: int = 64, context: int = 200, repeats: int = 7, max_new_tokens: int = 128,
              max_depth: int | None = None, temperature: float = 0.0, seed: int = 0, eos_token_id: int | None = None,
              progress: bool = True, source_tokens: int | None = None) -> dict:
    """Measure, estimate and recommend. Returns the profile (a JSON-able dict). Prompts: ids (1, T).
    `source_tokens`: new tokens a run when the draft sources are compared for greedy decoding (default:
    max_new_tokens; `SOURCE_TOKENS` says why the first-use calibration takes more)."""
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
    # the train-free sources draft a layer with no forward, so a wider tree costs them only its verification,
    # which each run measures: they also try twice the chosen budget, up to twice the grid's largest
    source_options = dict(options, max_new_tokens=source_tokens or max_new_tokens)
    sources = drafter_run(target, draft, prompts, drafter_runs(chosen["budget"], 2 * budgets[-1]), chosen["delta"],
                          source_options, progress, draft_temperature)
    sampled_temperature = profile_draft_temperature(alignment, SAMPLED_TEMPERATURE)
    acceptance = sequoia.profile_vector(alignment, greedy=False)  # sampled children's p-hat, as generate takes it
    sampled = drafter_run(target, draft, prompts, sampled_runs(chosen["budget"]), chosen["delta"],
                          dict(options, temperature=SAMPLED_TEMPERATURE, acceptance=acceptance), progress,
                          sampled_temperature)
    probe_after = probe_ms(target, cached)
    return {
        "version": PROFILE_VERSION,
        "step_revision": STEP_REVISION,
        "key": profile_key(target, draft),
        "date": now(),
        "machine": machine_info(),
        "hardware": hardware_key(target.device),
        "target": target.config._name_or_path,
        "draft": draft.config._name_or_path,
        "dtype": dtype_name(target),
        "settings": dict(options, prompts=len(prompts), context=context, repeats=repeats,
                         source_tokens=source_options["max_new_tokens"]),
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


# ---- first use -----------------------------------------------------------------------------------

FIRST_USE = dict(prompts=3, max_tokens=17, repeats=3, max_new_tokens=48, source_tokens=SOURCE_TOKENS,
                 budgets=(2, 4, 8, 12, 16), deltas=(0.3, 0.6))  # the same as `opttree calibrate --quick`


def calibrate_on_first_use(target, draft, tokenizer, progress: bool = True) -> dict | None:
    """A quick calibration (FIRST_USE) of a pair that has no profile on this machine, saved to the user
    cache, with one message saying what it chose and why. None if `$OPTTREE_AUTO_CALIBRATE` is 0, the
    pair already has a profile, there is no draft (the train-free sources need no calibration), or the
    machine looked disturbed during the measurement (then nothing is saved). A profile that lacks the draft
    sources' measurements (`measured_sources`: an older one, or the shipped one) counts as none."""
    if draft is None or os.environ.get(AUTO_ENV, "1") == "0":
        return None
    found = find_profile(target, draft)
    profile = json.loads(found.read_text()) if found is not None else None
    passive = profile is not None and measured_passively(profile)
    older = profile is not None and profile.get("step_revision", 0) < STEP_REVISION
    if profile is not None and measured_sources(profile) and not passive and not older:
        return None
    why = ("no calibration profile for this pair on this machine" if profile is None else
           "the calibration profile of this pair here was measured with OpenMP's passive waiting, which this "
           "process does not use" if passive else
           "the calibration profile of this pair here predates the draft sources' measurements"
           if not measured_sources(profile) else
           "the calibration profile of this pair here was measured by an older opttree (its steps cost differently, "
           "or it compared the draft sources over shorter generations)")
    print(f"opttree: {why}: a quick one first (about a minute at most; {AUTO_ENV}=0 skips it, `opttree calibrate` "
          "runs the full one)", file=sys.stderr)
    prompts = [tokenizer(p, return_tensors="pt", add_special_tokens=False).input_ids
               for p in CALIBRATION_PROMPTS[: FIRST_USE["prompts"]]]
    profile = run_calibration(target, draft, prompts, budgets=FIRST_USE["budgets"], deltas=FIRST_USE["deltas"],
                              max_tokens=FIRST_USE["max_tokens"], repeats=FIRST_USE["repeats"],
                              max_new_tokens=FIRST_USE["max_new_tokens"], eos_token_id=tokenizer.eos_token_id,
                              progress=progress, source_tokens=FIRST_USE.get("source_tokens"))
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


def measured_passively(profile: dict) -> bool:
    """Whether a profile was measured with OpenMP's passive waiting (on a busy machine, or by every command
    before 2026-11-27) while this process spins: its timings, and so its choices, are not this process's."""
    policy = profile.get("machine", {}).get("omp_wait_policy")
    return policy == "PASSIVE" and os.environ.get("OMP_WAIT_POLICY") != "PASSIVE"


def calibrate_first(args, target, draft, tokenizer) -> None:
    """For generate, demo and serve: a pair run with the default settings (no --budget, --tree or
    --drafter) and no profile on this machine is calibrated first (`calibrate_on_first_use`)."""
    if args.tp:  # timings differ between ranks: a sharded pair takes the profile it has
        return
    if args.budget is None and args.tree is None and args.drafter is None:
        calibrate_on_first_use(target, draft, tokenizer, progress=sys.stderr.isatty())
