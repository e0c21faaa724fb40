"""From raw records to results.json, markdown tables and PNG plots.

Aggregates, per method label and category ("all" = every prompt):
- mean accepted length = total new tokens / total steps (bonus included; AR scores 1.0)
- tokens/s = total new tokens / total wall time (prefill included)
- speedup = tokens/s / ar's tokens/s over the same prompts of the same run
- per-prompt speedup (min / median / max): each prompt's tokens/s over ar's on that prompt
- mismatches = runs whose tokens differ from ar's (temperature 0 only; None when not checked)
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


ALL = "all"
SLOW_FACTOR = 5.0  # a run this many times slower per token than its method's median is flagged
SUMMARY_KEYS = ("method", "budget", "row_budgets", "category", "prompts", "mean_accepted_length", "tokens_per_second",
                "speedup", "mismatches")


def summarize(records: list[dict]) -> list[dict]:
    """Summary rows, `all` first, then each category in order of appearance; methods in run order."""
    categories = [ALL] + list(dict.fromkeys(r["category"] for r in records))
    labels = list(dict.fromkeys(r["label"] for r in records))
    rows = []
    for category in categories:
        chosen = [r for r in records if category == ALL or r["category"] == category]
        per_label = {label: [r for r in chosen if r["label"] == label] for label in labels}
        baseline = per_label["ar"]
        for label in labels:
            rows.append(summary_row(per_label[label], baseline, category))
    return rows


def summary_row(runs: list[dict], baseline: list[dict], category: str) -> dict:
    first = runs[0]
    tokens = sum(r["new_tokens"] for r in runs)
    seconds = sum(r["time_s"] for r in runs)
    steps = [r["steps"] for r in runs]
    speed, base_speed = rate(runs), rate(baseline)
    per_prompt = per_prompt_speedups(runs, baseline)
    checked = [r["mismatch"] for r in runs if r["mismatch"] is not None]
    return {
        "method": first["method"],
        "budget": first["budget"],
        "category": category,
        "prompts": len({r["prompt_id"] for r in runs}),
        "mean_accepted_length": tokens / sum(steps) if None not in steps and sum(steps) else None,
        "tokens_per_second": speed,
        "speedup": speed / base_speed if base_speed else None,
        "mismatches": sum(checked) if checked else None,
        "label": first["label"],
        "delta": first["delta"],
        "runs": len(runs),
        "new_tokens": tokens,
        "time_s": seconds,
        "accepted_histogram": merge_histograms([r["accepted_histogram"] for r in runs]),
        "speedup_min": min(per_prompt) if per_prompt else None,
        "speedup_median": statistics.median(per_prompt) if per_prompt else None,
        "speedup_max": max(per_prompt) if per_prompt else None,
        "draft_ms_per_step": per_step_ms(runs, "draft_s"),
        "verify_ms_per_step": per_step_ms(runs, "verify_s"),
        "warmup_s": first.get("warmup_s"),  # the untimed warm-up (compilation, for a compiled method)
        "host_syncs_per_step": first.get("host_syncs_per_step"),  # counted once per method (runner.host_costs)
        "ops_per_step": first.get("ops_per_step"),
        # the budgets a batch's rows drafted where they are not the method's (sized for the batch)
        "row_budgets": sorted({r["row_budget"] for r in runs if r.get("row_budget") not in (None, first["budget"])}),
    }


def per_step_ms(runs: list[dict], key: str) -> float | None:
    """Milliseconds of `key` (draft_s, verify_s) per target step; None where not measured (peers)."""
    if any(r.get(key) is None or not r["steps"] for r in runs):
        return None
    return 1000 * sum(r[key] for r in runs) / sum(r["steps"] for r in runs)


def rate(runs: list[dict]) -> float:
    """Total new tokens / total seconds."""
    seconds = sum(r["time_s"] for r in runs)
    return sum(r["new_tokens"] for r in runs) / seconds if seconds > 0 else 0.0


def per_prompt_speedups(runs: list[dict], baseline: list[dict]) -> list[float]:
    """For each prompt: its tokens/s (over repeats) / ar's tokens/s on the same prompt."""
    out = []
    for prompt_id in dict.fromkeys(r["prompt_id"] for r in runs):
        mine = rate([r for r in runs if r["prompt_id"] == prompt_id])
        base = rate([r for r in baseline if r["prompt_id"] == prompt_id])
        if base > 0:
            out.append(mine / base)
    return out


def merge_histograms(histograms: list[list[int] | None]) -> list[int] | None:
    if any(h is None for h in histograms):
        return None
    merged = [0] * max((len(h) for h in histograms), default=0)
    for h in histograms:
        for a, count in enumerate(h):
            merged[a] += count
    return merged


def slow_runs(records: list[dict], factor: float = SLOW_FACTOR) -> list[dict]:
    """Runs whose seconds per new token exceed `factor` x their method's median: a sign of machine
    contention or a missed warm-up. Reported, never dropped (the totals include them)."""
    out = []
    for label in dict.fromkeys(r["label"] for r in records):
        runs = [r for r in records if r["label"] == label and r["new_tokens"]]
        if not runs:
            continue
        typical = statistics.median(r["time_s"] / r["new_tokens"] for r in runs)
        for r in runs:
            ratio = r["time_s"] / r["new_tokens"] / typical
            if ratio > factor:
                out.append({"label": label, "prompt_id": r["prompt_id"], "repeat": r["repeat"], "time_s": r["time_s"],
                            "times_median": ratio})
    return out


# ---- markdown ------------------------------------------------------------------------------------


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(results: dict) -> str:
    """A header (models, settings, machine) and one table per category."""
    meta = results["meta"]
    lines = [
        "# opttree bench",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; machine: {meta['machine']['processor']}, {meta['machine']['cpu_count']} CPUs, "
        f"torch {meta['machine']['torch']} ({meta['machine']['torch_threads']} threads), "
        f"transformers {meta['machine']['transformers']}"
        + (f"; GPU: {meta['machine']['cuda']}" if meta['machine'].get("cuda") else ""),
        f"- target: `{meta['target']}`; draft: `{meta['draft']}`; device {meta.get('device', 'cpu')}"
        + (f" (draft {meta['draft_device']})" if meta.get("draft_device") not in (None, meta.get("device")) else "")
        + f"; dtype {meta['dtype']}"
        + (f" (draft {meta['draft_dtype']})" if meta.get("draft_dtype") not in (None, meta["dtype"]) else "")
        + ("; opttree's layers packed for this CPU's bf16 kernels (same tokens; hf-* peers run transformers' own)"
           if meta.get("packed", {}).get("target") else ""),
        f"- prompts: {meta['prompts']} from `{meta['prompt_file']}` ({len(results['skipped'])} skipped as too long); "
        f"max new tokens {meta['settings']['max_new_tokens']}; temperature {meta['settings']['temperature']}; "
        f"repeats {meta['repeats']}; tree policies: delta {meta['settings']['delta']:g} (unless shown), "
        f"max depth {meta['settings']['max_depth']}",
        "- mean accepted length = new tokens / target steps, bonus token included (plain decoding: 1.00); "
        "speedup = tokens/s over `ar`'s in this run (prefill included); per-prompt speedup: min / median / max; "
        "host syncs and dispatched ops per step counted in one untimed run of at most 64 tokens on the first prompt "
        "(prefill included; per token for peers whose steps are not observable)",
    ]
    mismatched = sum(r["mismatches"] or 0 for r in results["summary"] if r["category"] == ALL)
    if meta["settings"]["temperature"] == 0:
        lines.append(f"- outputs differing from `ar` (temperature 0): **{mismatched}** runs"
                     + (" (exactness is guaranteed in float32; other dtypes round tree forwards differently)"
                        if mismatched and meta["dtype"] != "float32" else ""))
    else:
        lines.append("- temperature > 0: outputs are samples, not compared with `ar`")
    slow = results.get("slow_runs", [])
    if slow:
        worst = max(slow, key=lambda r: r["times_median"])
        lines.append(f"- **{len(slow)} runs took over {SLOW_FACTOR:g}x their method's median time per token** (worst: "
                     f"{worst['label']} on {worst['prompt_id']}, {worst['times_median']:.0f}x); they are included in "
                     "the figures: was the machine busy? (`slow_runs` in results.json lists them)")
    lines += ["- methods: " + "; ".join(f"`{name}`: {about}" for name, about in meta.get("methods", {}).items())]
    warmups = {r["label"]: r.get("warmup_s") for r in results["summary"] if r["category"] == ALL}
    if any(w is not None for w in warmups.values()):
        lines.append("- untimed warm-up before the timed runs (two short runs each; compilation happens here): "
                     + ", ".join(f"{label} {fmt(w, '.1f')} s" for label, w in warmups.items()))
    categories = list(dict.fromkeys(r["category"] for r in results["summary"]))
    if len(categories) == 2:  # one category: its table would repeat 'all'
        lines.append(f"- every prompt is in one category ({categories[1]}): one table")
        categories = [ALL]
    for category in categories:
        rows = [r for r in results["summary"] if r["category"] == category]
        lines += ["", f"## {category}", "", table(rows, meta["settings"]["delta"])]
    return "\n".join(lines) + "\n"


def table(rows: list[dict], default_delta: float | None = None) -> str:
    """Markdown rows; a budget shows its delta when it is not `default_delta`."""
    out = ["| method | budget | prompts | mean accepted length | tokens/s | speedup | per-prompt speedup "
           "(min / median / max) | draft / verify ms per step | host syncs / ops per step | mismatches |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        budget = "" if r["budget"] is None else str(r["budget"])
        if r["delta"] is not None and r["delta"] != default_delta:
            budget += f" (δ {r['delta']:g})"
        if r.get("row_budgets"):
            budget += f", sized to {'/'.join(map(str, r['row_budgets']))}"
        spread = " / ".join(fmt(r[k], ".2f") for k in ("speedup_min", "speedup_median", "speedup_max"))
        step_ms = f"{fmt(r.get('draft_ms_per_step'), '.1f')} / {fmt(r.get('verify_ms_per_step'), '.1f')}"
        costs = f"{fmt(r.get('host_syncs_per_step'), '.1f')} / {fmt(r.get('ops_per_step'), '.0f')}"
        out.append(f"| {r['method']} | {budget} | {r['prompts']} | {fmt(r['mean_accepted_length'], '.2f')} | "
                   f"{fmt(r['tokens_per_second'], '.1f')} | {fmt(r['speedup'], '.2f')}x | {spread} | {step_ms} | "
                   f"{costs} | {fmt(r['mismatches'], 'd')} |")
    return "\n".join(out)


# ---- plots ---------------------------------------------------------------------------------------


def plot(results: dict, out_dir: Path) -> list[Path]:
    """mal_vs_budget.png, speedup_vs_budget.png, accepted_histogram.png (category 'all'), and
    speedup_by_method.png: every method's speedup and MAL, overall and per category. Each figure is
    titled with the run's conditions (prompts, tokens, dtype, temperature, delta, draft temperature,
    machine, date); speedups show the per-prompt spread (min to max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["summary"] if r["category"] == ALL]
    about = conditions(results["meta"])
    paths = []
    for key, ylabel, filename in (("mean_accepted_length", "mean accepted length (tokens / step)", "mal_vs_budget.png"),
                                  ("speedup", "speedup over ar (tokens/s ratio)", "speedup_vs_budget.png")):
        fig, ax = plt.subplots(figsize=(7.2, 4.8))
        series = budget_series(rows, key, results["meta"]["settings"]["delta"])
        for i, (label, points) in enumerate(series.items()):
            budgets = [p[0] for p in points]
            ax.plot(budgets, [p[1][key] for p in points], marker="o", label=label, color=f"C{i % 10}")
            if key == "speedup":  # the per-prompt spread: min to max
                ax.fill_between(budgets, [p[1]["speedup_min"] or 0 for p in points],
                                [p[1]["speedup_max"] or 0 for p in points], color=f"C{i % 10}", alpha=0.12)
        flat = [r for r in rows if r["budget"] is None and r[key] is not None]  # ar and the peers: one value
        for i, r in enumerate(flat, start=len(series)):
            ax.axhline(r[key], linestyle="--", linewidth=1, color=f"C{i % 10}", label=r["label"])
        budgets = sorted({b for points in series.values() for b, _ in points})
        if budgets:
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (draft nodes per step)")
        ax.set_ylabel(ylabel)
        if key == "speedup":
            ax.text(0.99, 0.01, "bands: per-prompt speedup, min to max", transform=ax.transAxes, ha="right",
                    va="bottom", fontsize=7, color="0.4")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        title(fig, ylabel.split(" (")[0].capitalize() + " by budget", about)
        paths.append(save(plt, fig, out_dir / filename))
    fig = fig_histograms(plt, rows)
    title(fig, "Accepted draft tokens per step", about)
    paths.append(save(plt, fig, out_dir / "accepted_histogram.png"))
    fig = fig_by_method(plt, results["summary"])
    title(fig, "Speedup and mean accepted length by method", about)
    paths.append(save(plt, fig, out_dir / "speedup_by_method.png"))
    return paths


def conditions(meta: dict) -> str:
    """One line of what a figure was measured under."""
    settings, machine = meta["settings"], meta["machine"]
    where = machine.get("cuda") or f"{machine['processor']}, {machine['cpu_count']} CPUs"
    tau = settings.get("draft_temperature")
    return (f"{meta['prompts']} prompts ({Path(meta['prompt_file']).name}), {settings['max_new_tokens']} new tokens, "
            f"{meta['dtype']}, temperature {settings['temperature']:g}, delta {settings['delta']:g}"
            + ("" if tau is None else f", draft temperature {tau:.3g}")
            + (", opttree's layers packed" if meta.get("packed", {}).get("target") else "")
            + f"; {where}; {meta['date'][:10]}")


def title(fig, heading: str, about: str) -> None:
    import textwrap

    width = int(fig.get_figwidth() * 15)  # characters that fit across the figure at this font size
    fig.suptitle("\n".join([heading, *textwrap.wrap(about, width)]), fontsize=9)


def fig_by_method(plt, summary: list[dict]):
    """Two panels of grouped bars: speedup (with the per-prompt min-max spread) and mean accepted
    length, one group per category ('all' first), one bar per method label (budget included)."""
    categories = list(dict.fromkeys(r["category"] for r in summary))
    categories = categories if len(categories) > 2 else [ALL]  # one category: the same figures as 'all'
    labels = [r["label"] for r in summary if r["category"] == ALL and r["label"] != "ar"]
    value = {(r["category"], r["label"]): r for r in summary}
    fig, axes = plt.subplots(2, 1, figsize=(min(16.0, max(7.2, 1.1 * len(categories) + 3)), 7.0), sharex=True)
    width = 0.8 / max(len(labels), 1)
    colors = [plt.cm.tab20(i % 20) if len(labels) > 10 else f"C{i}" for i in range(len(labels))]
    for ax, key, ylabel in ((axes[0], "speedup", "speedup over ar\n(bars: per-prompt min to max)"),
                            (axes[1], "mean_accepted_length", "MAL")):
        for i, label in enumerate(labels):
            cells = [value.get((c, label)) or {} for c in categories]
            heights = [cell.get(key) or 0 for cell in cells]
            spread = None
            if key == "speedup":
                spread = [[max(h - (cell.get("speedup_min") or h), 0) for h, cell in zip(heights, cells)],
                          [max((cell.get("speedup_max") or h) - h, 0) for h, cell in zip(heights, cells)]]
            ax.bar([c + (i - (len(labels) - 1) / 2) * width for c in range(len(categories))], heights, width,
                   label=label, color=colors[i], yerr=spread, error_kw=dict(elinewidth=0.6, capsize=1.5))
        if key == "speedup":
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7, ncol=min(len(labels), 4), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    axes[1].set_xticks(range(len(categories)), categories, rotation=30, ha="right", fontsize=8)
    return fig


def fig_histograms(plt, rows: list[dict]):
    """One panel per method (ar excluded), grouped bars per budget: fraction of steps by accepted draft
    tokens. transformers' peers report no acceptances: theirs are inferred from the cache's growth
    between forwards (hatched, and marked so in the panel's title)."""
    from matplotlib.ticker import MaxNLocator

    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["accepted_histogram"] and r["method"] != "ar":
            groups.setdefault(r["method"], []).append(r)
    cols = min(3, max(len(groups), 1))
    nrows = max((len(groups) + cols - 1) // cols, 1)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.4 * cols, 3.3 * nrows + 0.6), squeeze=False, sharey=True)
    for ax, (method, members) in zip(axes.flat, groups.items()):
        inferred = method.startswith("hf-")
        width = 0.8 / len(members)
        for i, r in enumerate(members):
            hist = r["accepted_histogram"]
            label = r["label"] if r["budget"] is None else f"n={r['budget']}"
            ax.bar([a + (i - (len(members) - 1) / 2) * width for a in range(len(hist))],
                   [c / sum(hist) for c in hist], width, label=label, color=f"C{i % 10}",
                   hatch="//" if inferred else None, edgecolor="white" if inferred else None)
        ax.set_title(method + (" (inferred from cache growth)" if inferred else ""), fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    fig.supxlabel("accepted draft tokens per step (bonus excluded)", fontsize=10)
    fig.supylabel("fraction of steps", fontsize=10)
    return fig


def budget_series(rows: list[dict], key: str, default_delta: float) -> dict[str, list[tuple[int, dict]]]:
    """{policy (and delta, if not the default) -> [(budget, summary row)] sorted by budget} for the
    budgeted methods with a value for `key`."""
    series: dict[str, list[tuple[int, dict]]] = {}
    for r in rows:
        if r["budget"] is not None and r[key] is not None:
            name = r["method"] + ("" if r["delta"] == default_delta else f" (δ {r['delta']:g})")
            series.setdefault(name, []).append((r["budget"], r))
    return {name: sorted(points, key=lambda p: p[0]) for name, points in series.items()}


def save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- files ---------------------------------------------------------------------------------------


def write(results: dict, out_dir: Path) -> dict[str, Path]:
    """results.json, results.md and the plots in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    paths["json"].write_text(json.dumps(results, indent=1) + "\n")
    paths["markdown"].write_text(markdown(results))
    for path in plot(results, out_dir):
        paths[path.stem] = path
    return paths
