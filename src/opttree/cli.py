"""opttree: lossless speculative decoding over draft trees. Commands: demo, generate, datastore, models,
train, bench, calibrate, serve, load-test; `opttree COMMAND --help` describes each."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import threads

threads.choose_openmp_wait_policy(passive=sys.argv[1:2] == ["train"])  # before torch loads OpenMP: see threads.py

from .errors import RanksDiverged  # noqa: E402
from .flags import (  # noqa: E402  (shared by the commands; importing no torch: `--help` stays fast)
    add_decoding_args,
    add_tp_arg,
    add_tree_args,
    check_model_dir,
    load_pair,
    resolved_tree_options,
    tree_options,
    used_draft,
)
from .settings.names import TRAINED_SOURCES  # noqa: E402

DEMO_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n",
]


def check_flags(args) -> None:
    """Flag values that cannot work, reported before any model loads."""
    if (getattr(args, "max_new_tokens", 0) or 0) < 0:  # None: calibrate's default, set later
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if getattr(args, "temperature", 0.0) < 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 <= getattr(args, "min_p", 0.0) <= 1:  # NaN too
        raise ValueError(f"--min-p must be in [0, 1] (0 = off), got {args.min_p}")
    if args.command == "calibrate" and getattr(args, "target", None) and not getattr(args, "draft", None):
        raise ValueError("calibrate measures a target/draft pair: --target needs --draft")
    drafter = getattr(args, "drafter", None)  # a DrafterSpec: parsed (and checked) by argparse
    if drafter is not None:
        if getattr(args, "draft", None) and not drafter.uses_draft_model:
            raise ValueError(f"--draft is given but --drafter {drafter} does not use it: add 'model' "
                             f"(--drafter model+{drafter}) or leave --draft out")
        if getattr(args, "tree", None) == "ar":
            raise ValueError(f"--tree ar drafts nothing: --drafter {drafter} does not apply")
        for source, option in TRAINED_SOURCES.items():
            if getattr(args, option, None) and source not in drafter:
                raise ValueError(f"--{source} is given but --drafter {drafter} does not use it: add '{source}' "
                                 f"(--drafter {source}+{drafter}) or leave --{source} out")
    out = getattr(args, "out", None) if args.command in ("bench", "calibrate") else None
    if out is not None and __import__("os").path.isfile(out):
        raise ValueError(f"--out {out}: is a file; pass a directory (created if missing)")


def read_prompt(args) -> str:
    """--prompt, or --prompt-file (`-` = stdin) for multi-line prompts; invalid UTF-8 is a clear error."""
    if args.prompt_file is not None:
        try:
            data = sys.stdin.buffer.read() if args.prompt_file == "-" else open(args.prompt_file, "rb").read()
        except OSError as err:
            raise ValueError(f"--prompt-file {args.prompt_file}: {err.strerror}") from None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"--prompt-file {args.prompt_file}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("--prompt is not valid UTF-8 (check the terminal's encoding, or use --prompt-file)") from None
    return args.prompt


def cmd_generate(args) -> int:
    from .calibration import calibrate_first
    from .speculator import Request, Speculator
    from .text import TextStream

    prompt = read_prompt(args)
    target, draft, tokenizer = load_pair(args)
    calibrate_first(args, target, draft, tokenizer)  # a pair new to this machine, default settings
    tree = resolved_tree_options(args, target, draft)
    speculator = Speculator(target, used_draft(tree, draft), tokenizer=tokenizer, **tree)
    prompt_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    run = speculator.stream(Request(prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                                    stop=args.stop, logits_processor=grammar_of(args, target, tokenizer,
                                                                                 prompt_ids.shape[1])))
    if not args.json:
        print(prompt, end="", flush=True)
    text = TextStream(tokenizer)  # a character split across chunks prints once it is whole
    for chunk in run:
        if not args.json:
            print(text.push(chunk.tolist()), end="", flush=True)
    if not args.json:
        print(text.push([], final=True), flush=True)
    new = run.sequences[0, prompt_ids.shape[1]:]
    s = run.stats
    if args.json:
        print(json.dumps({
            "text": tokenizer.decode(new), "token_ids": new.tolist(), "new_tokens": s.new_tokens, "steps": s.steps,
            "mean_accepted_length": s.mean_accepted_length, "tokens_per_second": s.tokens_per_second,
            "time_s": s.time_s, "tree": tree["tree"], "drafter": run.config.drafter and str(run.config.drafter),
            "budget": tree["budget"], "delta": tree["delta"],
            "draft_temperature": tree["draft_temperature"], "static": run.config.static, "children": run.config.children,
            "temperature": run.config.temperature, "min_p": run.config.min_p, "stats": s.to_dict(),
        }))
    else:
        print(f"\n[{s.new_tokens} tokens in {s.steps} steps: mean accepted length {s.mean_accepted_length:.2f}, "
              f"{s.tokens_per_second:.1f} tokens/s]", file=sys.stderr)
    return 0


def grammar_of(args, target, tokenizer, prompt_len: int) -> list | None:
    """The grammar `generate`'s flags hold the answer to, as a logits processor (None: none)."""
    from .grammar import Constraint, one_of
    from .settings.arguments import eos_list
    from .speculator import _vocab_size

    schema = args.json_schema
    if schema is not None and not schema.lstrip().startswith("{"):
        schema = read_text_file(schema, "--json-schema")
    lark = args.grammar and read_text_file(args.grammar, "--grammar")
    held_to = one_of(json_schema=schema, json_object=args.json_object, regex=args.regex, choice=args.choice,
                     lark=lark)
    if held_to is None:
        return None
    eos = eos_list(target.generation_config.eos_token_id) or None
    return [Constraint(tokenizer, held_to, prompt_len, eos, _vocab_size(target))]


def read_text_file(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as error:
        raise ValueError(f"{flag} {path}: {error.strerror}") from None


DEMO_SHOWN_LINES = 12  # completion lines the demo prints per prompt


def shown_completion(completion: str, max_lines: int = DEMO_SHOWN_LINES) -> str:
    """A completion as the demo prints it: a run of 3 or more identical lines (a small model's runaway
    output, e.g. 50 lines of `    #`) shown once with its count, at most `max_lines` lines, then how
    many lines were left out. The text itself is never changed, only cut."""
    lines = completion.split("\n")
    shown, i = [], 0
    while i < len(lines) and len(shown) < max_lines:
        run = 1
        while i + run < len(lines) and lines[i + run] == lines[i]:
            run += 1
        shown.append(lines[i])
        if run >= 3:
            shown.append(f"[... the same line {run - 1} more times]")
            i += run
        else:
            i += 1
    left = len(lines) - i
    if left:
        shown.append(f"[... {left} more line{'s' if left > 1 else ''}]")
    return "\n".join(shown)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index of the first differing token of two (new,) id tensors (a shorter one differs where it
    ends); None when equal."""
    n = min(a.shape[0], b.shape[0])
    unequal = (a[:n] != b[:n]).nonzero()
    if unequal.numel():
        return int(unequal[0, 0])
    return None if a.shape[0] == b.shape[0] else n


def cmd_demo(args) -> int:
    """`opttree demo`: complete a few code prompts with OPT-Tree and with plain decoding, interleaved."""
    from .calibration import calibrate_first
    from .calibration.measure import noise_problem, probe_ms
    from .device import dtype_name
    from .speculator import Request, Speculator

    target, draft, tokenizer = load_pair(args)
    dtype = dtype_name(target)  # what --dtype (auto by default) loaded
    calibrate_first(args, target, draft, tokenizer)  # a pair new to this machine, default settings
    tree = tree_options(args, target, draft)
    draft = used_draft(tree, draft)
    common = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed)
    label = f"{tree['tree']}:{tree['drafter']}" if tree.get("drafter") and tree["tree"] != "ar" else tree["tree"]
    methods = {name: Speculator(target, draft, eos_token_id=tokenizer.eos_token_id, **options)
               for name, options in (("ar", dict(tree="ar")), (label, tree))}
    prompts = [tokenizer(p, return_tensors="pt").input_ids for p in DEMO_PROMPTS]
    methods[label].generate(Request(prompts[0], max_new_tokens=8, **common))  # warm-up
    probe_before = probe_ms(target, prompts[0][0])  # the same 1-token forward, timed before and after
    totals = {name: {"tokens": 0, "steps": 0, "time": 0.0, "per_prompt": []} for name in methods}
    differences = []  # {"prompt": 1-based number, "token": index of the first new token that differs}
    for number, (text, ids) in enumerate(zip(DEMO_PROMPTS, prompts), start=1):
        outputs = {}
        for name, speculator in methods.items():
            out = speculator.generate(Request(ids, max_new_tokens=args.max_new_tokens, **common))
            outputs[name] = out
            totals[name]["tokens"] += out.stats.new_tokens
            totals[name]["steps"] += out.stats.steps
            totals[name]["time"] += out.stats.time_s
            totals[name]["per_prompt"].append(out.stats.mean_accepted_length)
        ours, plain = outputs[label].new_tokens, outputs["ar"].new_tokens
        token = first_difference(ours, plain)
        if token is None:
            verdict = "identical to plain decoding"
        else:
            differences.append({"prompt": number, "token": token})
            verdict = (f"differs from plain decoding from new token {token}: "
                       f"{tokenizer.decode(ours[token:token + 3])!r} instead of {tokenizer.decode(plain[token:token + 3])!r}")
        if not args.json:
            print(f"--- prompt {number}, {label}: mean accepted length "
                  f"{outputs[label].stats.mean_accepted_length:.2f}; {verdict} ---")
            print(text + shown_completion(tokenizer.decode(ours)))
    disturbed = noise_problem(probe_before, probe_ms(target, prompts[0][0]), "the demo")
    rows = []
    ar_speed = totals["ar"]["tokens"] / totals["ar"]["time"]
    for name, t in totals.items():
        speed = t["tokens"] / t["time"]
        rows.append({"method": name, "mean_accepted_length": t["tokens"] / t["steps"],
                     "mean_accepted_length_per_prompt": sum(t["per_prompt"]) / len(t["per_prompt"]),
                     "tokens_per_second": speed, "speedup": speed / ar_speed})
    same = len(prompts) - len(differences)
    if args.json:
        print(json.dumps({"rows": rows, "identical_to_ar": same, "differences": differences, "prompts": len(prompts),
                          "budget": tree["budget"], "drafter": str(tree.get("drafter") or "") or None, "dtype": dtype,
                          "disturbed": disturbed or None}))
        return 0
    width = max(10, len(label) + 2)
    print(f"\n{'method':<{width}}{'accepted/step':>15}{'prompt mean':>13}{'tokens/s':>12}{'speedup':>10}")
    for r in rows:
        print(f"{r['method']:<{width}}{r['mean_accepted_length']:>15.2f}{r['mean_accepted_length_per_prompt']:>13.2f}"
              f"{r['tokens_per_second']:>12.1f}{r['speedup']:>9.2f}x")
    print("(accepted/step: all new tokens over all steps, so a prompt weighs by its steps; prompt mean: the "
          "mean of the per-prompt figures above)")
    where = "; ".join(f"prompt {d['prompt']} from new token {d['token']}" for d in differences)
    drafted_by = f"drafter {tree.get('drafter') or 'model'}, " if tree["tree"] != "ar" else ""
    print(f"\n{same}/{len(prompts)} completions identical to plain decoding{' (' + where + ' differs)' if where else ''} "
          f"({dtype}, temperature {args.temperature}, {drafted_by}budget {tree['budget']}, delta {tree['delta']:g}, "
          f"draft temperature {tree['draft_temperature']:.2g})")
    if disturbed:
        print(f"WARNING: the machine looked disturbed during the demo ({disturbed}): the speedups above are not "
              "reliable; run it again on a quieter machine", file=sys.stderr)
    if args.temperature > 0:
        print("(sampling: the outputs follow the target's distribution exactly; the same tokens as plain "
              "decoding are not guaranteed at temperature > 0)")
    elif differences and dtype != "float32":
        print(f"({dtype} rounds a forward over a tree differently from a one-token forward, so near-ties can "
              "flip; --dtype float32 is the exact reference, token for token)")
    return 0


def cmd_datastore_build(args) -> int:
    from transformers import AutoTokenizer

    from .demo import demo_paths
    from .step.drafters.datastore import build_datastore

    target_path = args.target or demo_paths()[0]
    check_model_dir(target_path, "--target")
    missing = [f for f in args.files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"no such file: {missing[0]}")
    meta = build_datastore(args.files, AutoTokenizer.from_pretrained(target_path), args.out)
    print(f"datastore {args.out}: {meta['tokens']} tokens from {len(args.files)} file(s), n-grams up to "
          f"{meta['max_n']} (use: --datastore {args.out})")
    return 0


def cmd_models(args) -> int:
    from .shipped import shipped_names, shipped_path

    if args.path is not None:
        print(shipped_path(args.path))
        return 0
    rows = [{"name": name, "path": str(shipped_path(name))} for name in shipped_names()]
    if args.json:
        print(json.dumps(rows))
    else:
        for row in rows:
            print(f"{row['name']:8} {row['path']}")
    return 0


class _Parser(argparse.ArgumentParser):
    """Flag errors on one line, as the command's other errors are (a bad value names the flag)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="opttree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the shipped pair: OPT-Tree vs plain decoding on a few code prompts")
    add_decoding_args(demo)
    add_tree_args(demo)
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="generate text with speculative decoding")
    add_decoding_args(gen)
    add_tree_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text (a newline in bash: --prompt $'a\\nb')")
    prompt.add_argument("--prompt-file", help="read the prompt from this file ('-' = stdin), for multi-line prompts")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    held = gen.add_argument_group("structured output (one of these: the answer is held to it, then ends with EOS)")
    held = held.add_mutually_exclusive_group()
    held.add_argument("--json-schema", metavar="SCHEMA", help="a JSON schema: a file, or the schema itself ('{...}')")
    held.add_argument("--json-object", action="store_true", help="any JSON object")
    held.add_argument("--regex", help="a regular expression the whole answer matches")
    held.add_argument("--choice", action="append", help="one of these strings (repeatable)")
    held.add_argument("--grammar", metavar="FILE", help="a Lark grammar (or llama.cpp's GBNF) in this file")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_tp_arg(gen)
    gen.set_defaults(func=cmd_generate)

    store = sub.add_parser("datastore", help="build a retrieval datastore from text files (for --datastore)")
    store_sub = store.add_subparsers(dest="datastore_command", required=True)
    build = store_sub.add_parser("build", help="tokenize FILES with the target's tokenizer and index their n-grams")
    build.add_argument("files", nargs="+", help="text files (each one a document)")
    build.add_argument("--out", required=True, help="the datastore folder (created)")
    build.add_argument("--target", help="the model whose tokenizer to use (default: the shipped pair)")
    build.set_defaults(func=cmd_datastore_build)

    models = sub.add_parser("models", help="the shipped models' folders (unpacked into the user cache on first use), "
                            "for --target/--draft/--head: --target \"$(opttree models --path target)\"")
    models.add_argument("--path", choices=("target", "draft", "head"), help="print only this model's folder")
    models.add_argument("--json", action="store_true")
    models.set_defaults(func=cmd_models)

    for module in ("opttree.train.cli", "opttree.bench.cli", "opttree.server"):
        try:
            __import__(module, fromlist=["register"]).register(sub)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
    return parser


# Loggers of libraries imported with transformers that warn on every command about their own packaging
# (torchao's kernels built for another Python; torch's deprecation of torchao's Enum registration)
NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_transformers() -> None:
    """No weight-loading progress bars on every command, and no warnings that are not about the command."""
    import logging as stdlib_logging

    from transformers.utils import logging

    logging.disable_progress_bar()
    for name in NOISY_LOGGERS:
        stdlib_logging.getLogger(name).setLevel(stdlib_logging.ERROR)


def silence_other_ranks(args):
    """Under `--tp`, only rank 0 prints: the others' stdout and stderr go nowhere, but their errors still
    show, prefixed with their rank. Returns (the prefix for error messages, the stream errors go to:
    None = sys.stderr as it is when the error is printed)."""
    rank = int(os.environ.get("RANK", "0"))
    if not getattr(args, "tp", False) or rank == 0:
        return "opttree", None
    errors = sys.stderr
    sys.stdout = sys.stderr = open(os.devnull, "w")
    return f"opttree (rank {rank})", errors


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help (0), or a flag's error, said on one line (2)
        return done.code
    threads.set_torch_threads()
    name, errors = silence_other_ranks(args)
    try:
        check_flags(args)
        quiet_transformers()
        return args.func(args) or 0
    except (ValueError, NotImplementedError, FileNotFoundError, RanksDiverged) as err:
        print(f"{name}: error: {err}", file=errors or sys.stderr)
        return 2
    except BaseException:
        sys.stderr = errors or sys.stderr  # a rank's traceback shows
        raise


if __name__ == "__main__":
    sys.exit(main())
