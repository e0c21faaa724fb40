"""Calibration steps 3 and 4 (`opttree.calibration`): the cost model that estimates each setting's tokens/s
from the latency curves and the runs' counts, and the choices (the grid point, the draft sources)."""

from __future__ import annotations

import statistics

from .measure import Tally

CONFIRM = 0.9  # the estimate's choice must reach this fraction of the best measured tokens/s


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
    """Estimated tokens/s (docs/BENCH_USAGE.md, "`opttree calibrate`", step 3): new tokens / (steps * (modelled
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



def recommend_drafter(rows: list[dict]) -> dict:
    """The fastest measured draft sources and their budget, or plain decoding (tree 'ar') when none beats it."""
    best = max(rows, key=lambda r: r["measured_tokens_per_second"])
    if best["measured_speedup"] < 1:
        return {"tree": "ar", "drafter": None, "drafter_budget": None, "measured_speedup": 1.0,
                "why": f"no draft source beat plain decoding (best: {best['drafter']} at {best['measured_speedup']:.2f}x)"}
    return {"tree": best.get("tree", "opt"), "drafter": best["drafter"], "drafter_budget": best.get("budget"),
            "measured_speedup": best["measured_speedup"],
            "why": f"the fastest measured ({best['measured_speedup']:.2f}x plain decoding)"}
