"""`opttree bench` and `opttree calibrate`; the main CLI calls `register(subparsers)`."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from ..settings.config import DEFAULT_DELTA, DEFAULT_MAX_DEPTH, SOURCE_TOKENS, budget_arg
from ..settings.drafter_spec import DrafterSpec
from ..settings.names import TRAINED_HELP, TRAINED_SOURCES

BENCH_METHODS = "all"
BENCH_BUDGETS = "4,8,16"


def register(subparsers) -> None:
    from ..flags import add_decoding_args, add_draft_temperature_arg, add_length_predictor_arg, add_tp_arg

    bench = subparsers.add_parser("bench", help="speed of opttree's tree policies and transformers' peers, "
                                  "side by side on your prompts (results.json, tables, plots)")
    add_decoding_args(bench)
    bench.add_argument("--prompts", required=True, help="Spec-Bench (.jsonl: turns, category), HumanEval "
                       "(.jsonl: prompt) or plain text (one prompt per line, or blocks between '---' lines)")
    bench.add_argument("--methods", default=BENCH_METHODS, help="comma-separated: ar, tree policies "
                       "(opt, chain, ...), POLICY:DRAFTER for a policy over named draft sources (opt:recycling+lookup, "
                       "opt:model+lookup, ...), hf-assisted, hf-assisted-heuristic, hf-lookup, hf-ar; 'all' for every "
                       "built-in one (default: all). ar always runs: it is the baseline")
    bench.add_argument("--budgets", help="comma-separated draft-node budgets, each tree policy runs at every one; "
                       f"'auto' = the calibrated budget and delta (default: auto with a calibration profile for the "
                       f"pair, else {BENCH_BUDGETS})")
    bench.add_argument("--delta", type=float, help="delta for the numeric --budgets (default: the calibration "
                       f"profile's, else {DEFAULT_DELTA})")
    bench.add_argument("--max-depth", type=int, help=f"(default: {DEFAULT_MAX_DEPTH} with a draft model, else the budget)")
    add_draft_temperature_arg(bench)
    for source, option in TRAINED_SOURCES.items():
        bench.add_argument(f"--{source}", dest=option, help=f"{TRAINED_HELP[source]}, for the methods whose draft "
                           f"sources include '{source}' (opt:{source}, opt:{source}+lookup, ...)")
    add_length_predictor_arg(bench)
    bench.add_argument("--repeats", type=int, default=1, help="rounds over all prompts (default: 1)")
    bench.add_argument("--batch", type=int, default=1, help="B > 1: every method also runs groups of B prompts as "
                       "one batch, beside the same B one after another (labels 'METHOD xB'; tokens/s in aggregate). "
                       "opttree's methods and hf-ar take batches; transformers' assisted and lookup peers do not "
                       "(default: 1)")
    bench.add_argument("--categories", help="comma-separated categories to keep (default: all)")
    bench.add_argument("--per-category", type=int, help="at most this many prompts of each category")
    bench.add_argument("--limit", type=int, help="at most this many prompts in all")
    bench.add_argument("--out", default="bench-results", help="output directory (default: bench-results)")
    bench.add_argument("--no-progress", action="store_true")
    bench.add_argument("--json", action="store_true", help="print the summary rows as JSON")
    add_tp_arg(bench)
    bench.set_defaults(func=cmd_bench)

    cal = subparsers.add_parser("calibrate", help="measure forward latency and recommend budget and delta "
                                "for this machine (used by --budget auto)")
    add_decoding_args(cal)
    cal.set_defaults(max_new_tokens=None)
    cal.add_argument("--quick", action="store_true",
                     help="a quick calibration, well under a minute: " + describe_calibration(QUICK_CALIBRATION))
    cal.add_argument("--prompts", help="calibration prompts, any bench format (default: a few built-in code prompts)")
    cal.add_argument("--limit", type=int, help="at most this many prompts (default: 8; 3 with --quick)")
    cal.add_argument("--max-tokens", type=int, help="latency curve up to this many new tokens (default: 64; 17 with --quick)")
    cal.add_argument("--context", type=int, default=200, help="cached tokens before the timed forwards (default: 200)")
    cal.add_argument("--repeats", type=int, help="timed repeats per point, the median is kept (default: 7; 3 with --quick)")
    cal.add_argument("--source-tokens", type=int, help=f"new tokens a run when comparing the draft sources (default: "
                     f"{SOURCE_TOKENS}, also with --quick: the train-free sources gain along a generation)")
    cal.add_argument("--budgets", help="budget grid (default: 2,4,6,8,10,12,16,24,32; 2,4,8,12,16 with --quick)")
    cal.add_argument("--deltas", help="delta grid (default: 0.1,0.3,0.45,0.6; 0.3,0.6 with --quick)")
    cal.add_argument("--save-disturbed", action="store_true",
                     help="use the profile for --budget auto even if the noise check found the machine disturbed")
    cal.add_argument("--max-depth", type=int, help=f"(default: {DEFAULT_MAX_DEPTH} with a draft model, else the budget)")
    cal.add_argument("--out", default="calibration", help="output directory (default: calibration)")
    cal.add_argument("--no-progress", action="store_true")
    cal.add_argument("--json", action="store_true", help="print the recommendation as JSON")
    cal.set_defaults(func=cmd_calibrate)


FULL_CALIBRATION = dict(limit=8, max_tokens=64, repeats=7, max_new_tokens=128, source_tokens=SOURCE_TOKENS,
                        budgets="2,4,6,8,10,12,16,24,32", deltas="0.1,0.3,0.45,0.6")
QUICK_CALIBRATION = dict(limit=3, max_tokens=17, repeats=3, max_new_tokens=48, source_tokens=SOURCE_TOKENS,
                         budgets="2,4,8,12,16", deltas="0.3,0.6")


def describe_calibration(settings: dict) -> str:
    return ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in settings.items())


def with_calibration_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """calibrate's arguments with every setting the user left unset taken from the full or the --quick
    table (a new namespace; the parsed one is left as typed)."""
    table = QUICK_CALIBRATION if args.quick else FULL_CALIBRATION
    return argparse.Namespace(**{**vars(args), **{name: value for name, value in table.items()
                                                     if getattr(args, name) is None}})


# ---- argument parsing ----------------------------------------------------------------------------


def parse_list(text: str, kind, flag: str) -> list:
    """'4,8,16' -> [4, 8, 16]; a clear error naming the flag otherwise."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"{flag} is empty")
    try:
        return [kind(item) for item in items]
    except ValueError:
        raise ValueError(f"{flag} must be a comma-separated list of {kind.__name__}, got {text!r}") from None


def profile_defaults(args, target, draft, names: list[str]
                     ) -> tuple[list[str], DrafterSpec | None, str, float]:
    """(method names, drafter, --budgets, --delta): unset --budgets / --delta from the pair's calibration
    profile (as generate and demo do), else the fixed defaults. With the profile's budget, a bare `opt`
    also drafts with the sources the profile measured fastest (as generate and demo do): that drafter (whose
    measured budget 'auto' brings), else None; where the profile chose another tree policy for this temperature
    (a chain of draws, DySpec, with the draft model), a bare `opt` runs that policy, as generate does."""
    from ..profiles import auto_settings, find_profile, profile_sources

    profiled = find_profile(target, draft) is not None
    chosen = None
    if args.budgets is None and profiled:  # the choice measured for this temperature (greedy or sampled)
        sources = profile_sources(target, draft, args.temperature)
        tree, chosen = sources.get("tree", "opt"), sources.get("drafter")
        if chosen is None or tree == "ar" or "opt" not in names or (tree != "opt" and not chosen.uses_draft_model):
            chosen = None  # nothing for a bare `opt` to follow: it stays the draft model's
        elif tree != "opt":  # generate runs that policy (with the draft model) instead of OPT-Tree
            name = tree if chosen == "model" else f"{tree}:{chosen}"
            names = list(dict.fromkeys(name if n == "opt" else n for n in names))
            print(f"bench: opt runs {name} at the budget measured with it, as generate and demo do with this pair's "
                  f"calibration profile at temperature {args.temperature:g}; give --budgets to run OPT-Tree itself",
                  file=sys.stderr)
        elif chosen != "model":  # the draft model alone is what `opt` runs: its budget applies
            names = [f"opt:{chosen}" if n == "opt" else n for n in names]
            print(f"bench: opt drafts with {chosen} at the budget measured with it, as generate and demo do with "
                  "this pair's calibration profile; opt:model measures the draft model alone", file=sys.stderr)
    budgets = args.budgets or ("auto" if profiled else BENCH_BUDGETS)
    delta = args.delta
    if delta is None:
        delta = auto_settings(target, draft, temperature=args.temperature)[1] if profiled else DEFAULT_DELTA
    return names, chosen, budgets, delta


def parse_budgets(text: str, delta: float, target, draft, drafter: DrafterSpec | None = None, temperature: float = 0.0
                  ) -> list[tuple[int, float | None]]:
    """--budgets -> [(budget, delta or None)]: integers >= 1 use --delta; 'auto' brings the calibrated
    budget (the one measured with `drafter`, when that is the profile's choice) and delta, for greedy
    decoding or for sampling as `temperature` says."""
    budgets = []
    for item in parse_list(text, str, "--budgets"):
        try:
            item = budget_arg(item)
        except ValueError as error:
            raise ValueError(f"--budgets: {error}") from None
        if item == "auto":
            from ..profiles import auto_settings

            budget, auto_delta = auto_settings(target, draft, drafter, temperature)
            budgets.append((budget, auto_delta))
            continue
        budgets.append((item, None))
    if not 0 <= delta < 1:
        raise ValueError(f"--delta must be in [0, 1), got {delta}")
    return list(dict.fromkeys(budgets))


def method_names(text: str) -> list[str]:
    """--methods -> names, checked against the registry ('all' = every method)."""
    from .methods import check_names, method_table

    names = parse_list(text, str, "--methods")
    if names == ["all"]:
        return list(method_table())
    check_names(names)
    return names


def as_command(name: str, args) -> str:
    """The command line that repeats this run, every option spelled out (defaults included)."""
    words = ["opttree", name]
    for key, value in vars(args).items():
        if key in ("command", "func") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        words += [flag] if value is True else [flag, str(value)]
    return shlex.join(words)


# ---- commands ------------------------------------------------------------------------------------


def cmd_bench(args) -> int:
    from ..calibration import calibrate_on_first_use
    from ..flags import draft_temperature, load_pair
    from ..parallel import is_main, same_everywhere
    from ..profiles import profile_sources
    from . import report
    from .methods import Settings, expand_methods, parse_tree_method
    from .prompts import encode, load_prompts
    from .runner import prepare, run_bench

    categories = parse_list(args.categories, str, "--categories") if args.categories else None
    prompts = load_prompts(args.prompts, categories, args.limit, args.per_category)
    names = method_names(args.methods)
    target, draft, tokenizer = load_pair(args)
    if args.budgets is None and "opt" in names and not args.tp:  # `opt` with the defaults, as generate and demo
        calibrate_on_first_use(target, draft, tokenizer, progress=sys.stderr.isatty())  # run it: calibrated first
    names, chosen, budgets, delta = profile_defaults(args, target, draft, names)
    chosen_tree = profile_sources(target, draft, args.temperature).get("tree", "opt") if chosen is not None else None

    def budgets_of(name: str) -> list[tuple[int, float | None]]:  # 'auto': the budget calibrated for its sources
        tree, drafter = parse_tree_method(name)[:2]
        drafter = drafter or (chosen if tree == chosen_tree else None)  # the profile's choice: its measured budget
        return parse_budgets(budgets, delta, target, draft, drafter, args.temperature)

    specs = same_everywhere(expand_methods(names, budgets_of("opt"), budgets_of),
                            "methods and budgets")  # under --tp, every rank runs the same
    from ..parts import shipped_part

    trained = {option: getattr(args, option) for option in (*TRAINED_SOURCES.values(), "length_predictor")}
    for option in TRAINED_SOURCES.values():  # a part shipped for this target: recorded by its folder
        if trained[option] is None and (shipped := shipped_part(option, target)) is not None:
            trained[option] = str(shipped)
    settings = Settings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, min_p=args.min_p, seed=args.seed, delta=delta,
                        delta_given=args.delta is not None,
                        max_depth=args.max_depth,
                        eos_token_id=tokenizer.eos_token_id, draft_temperature=draft_temperature(args, target, draft),
                        draft_window=args.draft_window, trained=trained, static=args.static)
    from ..packed import packed_linears
    from .methods import PEERS

    if packed_linears(target) is not None and any(spec.name in PEERS for spec in specs):
        if str(target.dtype) == "torch.float32":  # (this module leaves torch unimported)
            what = ("opttree's tree steps run the float32 products of 2 rows or more from weights packed for this "
                    "CPU's kernels (within float32 rounding; `mismatches` counts outputs unlike plain decoding's)")
        else:
            what = ("opttree's methods (ar included) run the bf16 linear layers from weights packed for this CPU's "
                    "kernels (the same tokens)")
        print(f"bench: {what}; OPTTREE_PACKED=0 turns it off; the hf-* peers run transformers' own", file=sys.stderr)
    cases, skipped = prepare(prompts, lambda p: encode(tokenizer, p), target, args.max_new_tokens)
    for s in skipped:
        print(f"skipped {s['prompt_id']}: {s['reason']}", file=sys.stderr)
    records = run_bench(target, draft, cases, specs, settings, args.repeats, progress=not args.no_progress,
                        batch=args.batch)
    results = {
        "meta": bench_meta(args, target, draft, settings, specs, len(cases)),
        "prompts": [{"prompt_id": c.prompt.id, "category": c.prompt.category, "prompt_tokens": c.ids.shape[1]}
                    for c in cases],
        "skipped": skipped,
        "records": records,
        "summary": report.summarize(records),
        "slow_runs": report.slow_runs(records),
    }
    for slow in results["slow_runs"]:
        print(f"warning: {slow['label']} on {slow['prompt_id']} took {slow['times_median']:.0f}x its method's median "
              "time per token (machine busy?)", file=sys.stderr)
    if not is_main():  # sharded (--tp): rank 0 alone writes and prints
        return 0
    paths = report.write(results, Path(args.out))
    if args.json:
        print(json.dumps([{k: r[k] for k in report.SUMMARY_KEYS} for r in results["summary"]]))
    else:
        overall = [r for r in results["summary"] if r["category"] == report.ALL]
        print(report.table(overall, settings.delta))
        print(f"\nwrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


def bench_meta(args, target, draft, settings, specs, prompts: int) -> dict:
    """Everything needed to read and repeat a run: command, date, machine, models, settings, methods."""
    from ..device import dtype_name
    from ..hardware import machine_info, now
    from ..packed import packed_linears
    from ..speculator import use_static
    from .methods import find_method

    return {
        "command": as_command("bench", args),
        "date": now(),
        "machine": machine_info(),
        "target": target.config._name_or_path,
        "draft": None if draft is None else draft.config._name_or_path,
        "dtype": dtype_name(target),
        "device": str(target.device),
        "draft_device": None if draft is None else str(draft.device),
        "draft_dtype": None if draft is None else dtype_name(draft),
        "compiled": bool(args.compile),
        # opttree's steps run these models' bf16 linears from packed weights (`opttree.packed`); hf-* do not
        "packed": {"target": packed_linears(target) is not None, "draft": packed_linears(draft) is not None},
        "static": use_static(settings.static, target),
        "prompt_file": str(args.prompts),
        "prompts": prompts,
        "repeats": args.repeats,
        "settings": vars(settings),
        "methods": {name: find_method(name).about for name in dict.fromkeys(s.name for s in specs)},
    }


def cmd_calibrate(args) -> int:
    from ..calibration import report
    from ..calibration.run import CALIBRATION_PROMPTS, run_calibration
    from ..flags import load_pair
    from .prompts import encode, load_prompts, parse_text

    args = with_calibration_defaults(args)
    if args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    target, draft, tokenizer = load_pair(args)
    if args.prompts:
        prompts = load_prompts(args.prompts, limit=args.limit)
    else:
        prompts = parse_text(CALIBRATION_PROMPTS, "builtin")[:args.limit]
    budgets = parse_list(args.budgets, int, "--budgets")
    deltas = parse_list(args.deltas, float, "--deltas")
    if any(not 0 <= d < 1 for d in deltas):
        raise ValueError(f"--deltas must be in [0, 1), got {deltas}")
    profile = run_calibration(
        target, draft, [encode(tokenizer, p) for p in prompts], budgets=budgets, deltas=deltas,
        max_tokens=args.max_tokens, context=args.context, repeats=args.repeats, max_new_tokens=args.max_new_tokens,
        source_tokens=args.source_tokens, max_depth=args.max_depth, temperature=args.temperature, seed=args.seed,
        eos_token_id=tokenizer.eos_token_id, progress=not args.no_progress,
    )
    problem = profile["noise"]["problem"]
    if problem:
        print(f"opttree calibrate: WARNING: the machine looked disturbed: {problem}. "
              + ("Saved anyway (--save-disturbed)." if args.save_disturbed else
                 "This profile is NOT used by --budget auto; run again on a quieter machine "
                 "(or pass --save-disturbed)."), file=sys.stderr)
    paths = report.write(profile, Path(args.out), cache=args.save_disturbed or not problem)
    rec = profile["recommended"]
    if args.json:
        print(json.dumps(dict(rec, profile=str(paths["cached_profile"] or paths["profile"]), disturbed=bool(problem))))
    else:
        print(report.grid_table(profile))
        best = rec["best_measured"]
        print(f"\nrecommended: --budget {rec['budget']} --delta {rec['delta']:g} --draft-temperature "
              f"{rec['draft_temperature']:.3g} ({rec['chosen_by']}); measured "
              f"{rec['measured_tokens_per_second']:.1f} tokens/s vs best measured {best['measured_tokens_per_second']:.1f} "
              f"(budget {best['budget']}, delta {best['delta']:g}); plain decoding "
              f"{profile['ar_tokens_per_second']:.1f} tokens/s")
        print(report.drafter_table(profile))
        print(f"recommended draft sources: {rec['drafter'] or 'none: plain decoding (--tree ar)'} ({rec['why']}); "
              "generate, demo and serve use them when --drafter and --tree are not given")
        for note in (report.consistency_note(profile), report.no_gain_note(profile)):
            if note:
                print(note.removeprefix("- "))
        if paths["cached_profile"]:
            print(f"saved {paths['cached_profile']} (used by --budget auto) and {paths['profile']}", file=sys.stderr)
        else:
            print(f"saved {paths['profile']} only (not used by --budget auto)", file=sys.stderr)
    return 0
