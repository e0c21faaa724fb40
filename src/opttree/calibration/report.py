"""Calibration reports (`opttree.calibration`): the profile as markdown tables, the latency plot, the files."""

from __future__ import annotations

import json
from pathlib import Path

from ..profiles import DRAFT_TEMPERATURE_FIELD, SAMPLED_FIELD, save_profile
from .measure import RELIABILITY_FIELD

AGREEMENT = 1.5  # estimated / measured tokens/s outside [1/1.5, 1.5] (median over the grid): warn


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
