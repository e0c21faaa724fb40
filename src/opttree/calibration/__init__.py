"""Calibration (docs/BENCH_USAGE.md, "opttree calibrate"): what `opttree calibrate`, `--budget auto` and the
first use of a pair measure on this machine, and what they choose from it.

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
   sampled children at half, once and one and a half times the greedy budget and at 2 nodes, with lookup,
   a chain of 3 draws, DySpec, the train-free sources), with the draft at its sampled temperature, saved as
   SAMPLED_FIELD: what a sampled generation with the default settings runs.

Modules, in the order of the data: `measure` (steps 0-2, 5, 6: alignment, latency curves, the runs,
the noise probe), `estimate` (steps 3-4: the cost model and the choices), `run` (the whole calibration,
and the first use of a pair), `report` (markdown, plot, files). The profile is saved as
DIR/profile.json and in the user cache; `opttree.profiles` keys, finds and reads it back
(`auto_settings`, `profile_options`), and holds the shipped pair's profile.
"""

from .run import AUTO_ENV, FIRST_USE, calibrate_first, calibrate_on_first_use, run_calibration

__all__ = ["AUTO_ENV", "FIRST_USE", "calibrate_first", "calibrate_on_first_use", "run_calibration"]

