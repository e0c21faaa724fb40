"""Command line: `opttree demo | generate | train | bench | calibrate`."""

from __future__ import annotations

import argparse
import json
import sys

from . import threads

threads.choose_openmp_wait_policy()  # before torch loads OpenMP: see threads.py

import torch  # noqa: E402

from . import config as defaults  # noqa: E402
from .policies import available  # noqa: E402

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def add_decoding_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that decodes (kebab-case versions of SpecConfig's fields)."""
    parser.add_argument("--target", help="target model directory (default: the shipped pair)")
    parser.add_argument("--draft", help="draft model directory (default: the shipped pair's draft)")
    parser.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                        help="weights and activations; float32 is the exactness reference; 'auto' measures which of "
                        "bfloat16 / float32 makes a tree step faster on this machine (cached) (default: auto)")
    parser.add_argument("--draft-dtype", choices=sorted(DTYPES), default=None,
                        help="the draft's dtype, if not --dtype (a tiny draft can be faster in float32)")
    parser.add_argument("--device", default="auto", help="where the models run: cpu, cuda, cuda:1, mps, ... "
                        "('auto' = cuda when available, else cpu) (default: auto)")
    parser.add_argument("--draft-device", help="the draft's device, if not --device")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models' forwards: ~20%% "
                        "faster steps on a CPU after ~1 minute of compilation (pays for long runs)")
    parser.add_argument("--attn-implementation", choices=["sdpa", "eager"], default="sdpa",
                        help="attention kernels; eager for architectures without sdpa (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")


def add_tree_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tree", default="opt", help=f"tree policy: {', '.join(available())} (default: opt)")
    parser.add_argument("--budget", help="draft nodes per step, or 'auto' for the calibrated value (default: auto "
                        f"when the pair has a calibration profile, else {defaults.DEFAULT_BUDGET})")
    parser.add_argument("--delta", type=float, help="OPT-Tree: stop deepening when E(A) grows by <= delta "
                        f"(default: the calibrated one with --budget auto, else {defaults.DEFAULT_DELTA})")
    parser.add_argument("--max-depth", type=int, default=defaults.DEFAULT_MAX_DEPTH, help="(default: %(default)s)")
    add_draft_temperature_arg(parser)


def add_draft_temperature_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-temperature", type=float, help="divide the draft's logits by this before the "
                        "tree is built (p-hat calibration; lossless for any value > 0) (default: the pair's "
                        "calibration profile, else 1)")


def draft_temperature(args, target, draft) -> float:
    """--draft-temperature, else the value fitted by `opttree calibrate` for this pair, else 1."""
    from .bench.calibrate import profile_options

    if args.draft_temperature is not None:
        return args.draft_temperature
    return profile_options(target, draft, "opt", args.temperature).get("draft_temperature", 1.0)


def resolve_device(name: str) -> torch.device:
    """--device -> a torch device that exists here; a clear error otherwise."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a torch device (e.g. cpu, cuda, cuda:1, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine (torch {torch.__version__})")
    return device


def auto_dtype(target_path, draft_path, device: torch.device, tokens: int = 9, draft_layers: int = 3) -> str:
    """--dtype auto: the dtype in which one tree step (a target forward over `tokens` tokens and
    `draft_layers` draft forwards) measures faster here; cached per model pair and hardware."""
    import hashlib
    from pathlib import Path

    from .bench.calibrate import profile_dir
    from .demo import load_model
    from .hardware import choose_dtype, describe, forward_ms, hardware_key

    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    key = json.dumps([str(Path(target_path).resolve()), str(draft_path and Path(draft_path).resolve()),
                      hardware_key(device), tokens, draft_layers], sort_keys=True)
    cache = profile_dir() / f"dtype-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    if cache.exists():
        return json.loads(cache.read_text())["dtype"]
    step_ms = {}
    for name in ("bfloat16", "float32"):
        target = load_model(target_path, DTYPES[name]).to(device)
        step_ms[name] = forward_ms(target, tokens)
        if draft_path:
            step_ms[name] += draft_layers * forward_ms(load_model(draft_path, DTYPES[name]).to(device), tokens - 1)
    chosen = choose_dtype(step_ms)
    print(f"opttree: --dtype auto chose {chosen}: a tree step (target over {tokens} tokens + {draft_layers} draft "
          f"layers) measured {step_ms['bfloat16']:.1f} ms in bfloat16 and {step_ms['float32']:.1f} ms in float32 "
          f"on this machine ({describe(hardware_key(device))}); cached in {cache}", file=sys.stderr)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"dtype": chosen, "step_ms": step_ms, "key": json.loads(key)}) + "\n")
    return chosen


def check_model_dir(path, flag: str) -> None:
    """A clear error for a --target / --draft that is not a local model directory (before transformers
    would read it as a Hub repo id)."""
    from pathlib import Path

    folder = Path(path)
    if not folder.exists():
        raise ValueError(f"{flag} {path}: no such directory")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: is a file; pass the model's directory (with config.json and weights)")
    if not (folder / "config.json").exists() or not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ValueError(f"{flag} {path}: no model here (expected config.json and *.safetensors or *.bin weights)")


def check_flags(args) -> None:
    """Flag values that cannot work, reported before any model loads."""
    budget = getattr(args, "budget", None)
    if budget not in (None, "auto") and (not budget.isdigit() or int(budget) < 1):
        raise ValueError(f"--budget must be an integer >= 1 or 'auto', got {budget!r}")
    if (getattr(args, "max_new_tokens", 0) or 0) < 0:  # None: calibrate's default, set later
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if getattr(args, "temperature", 0.0) < 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if getattr(args, "target", None) and not getattr(args, "draft", None) and getattr(args, "tree", "ar") != "ar":
        raise ValueError("--target without --draft: pass --draft PATH, or --tree ar for plain decoding")
    out = getattr(args, "out", None) if args.command in ("bench", "calibrate") else None
    if out is not None and __import__("os").path.isfile(out):
        raise ValueError(f"--out {out}: is a file; pass a directory (created if missing)")


def load_pair(args):
    """(target, draft, tokenizer) from --target / --draft, or the shipped pair."""
    from transformers import AutoTokenizer

    from .demo import demo_paths, load_model

    if args.target is None:
        target_path, draft_path = demo_paths()
        draft_path = args.draft or draft_path
    else:
        target_path, draft_path = args.target, args.draft
    check_model_dir(target_path, "--target")
    if draft_path:
        check_model_dir(draft_path, "--draft")
    device = resolve_device(args.device)
    draft_device = resolve_device(args.draft_device or args.device)
    if args.dtype == "auto":
        args.dtype = auto_dtype(target_path, draft_path, device)
    dtype, draft_dtype = DTYPES[args.dtype], DTYPES[args.draft_dtype or args.dtype]
    attn = getattr(args, "attn_implementation", "sdpa")
    target = load_model(target_path, dtype, attn).to(device)
    draft = load_model(draft_path, draft_dtype, attn).to(draft_device) if draft_path else None
    if args.compile:
        from .device import compile_model

        target, draft = compile_model(target), draft and compile_model(draft)
    return target, draft, AutoTokenizer.from_pretrained(target_path)


def tree_options(args, target, draft) -> dict:
    """The SpecConfig fields of the tree flags. With a calibration profile for the pair (written by
    `opttree calibrate`, or shipped with the default pair), --budget defaults to 'auto': the budget and
    delta the profile recommends; its draft temperature and Sequoia vector apply too. Flags given win."""
    from .bench.calibrate import auto_settings, find_profile, profile_options

    budget = args.budget or ("auto" if find_profile(target, draft) is not None else str(defaults.DEFAULT_BUDGET))
    options = dict(tree=args.tree, max_depth=args.max_depth, delta=defaults.DEFAULT_DELTA)
    if budget == "auto":
        options["budget"], options["delta"] = auto_settings(target, draft)
    else:
        try:
            options["budget"] = int(budget)
        except ValueError:
            raise SystemExit(f"error: --budget must be an integer >= 1 or 'auto', got {budget!r}") from None
    if args.delta is not None:
        options["delta"] = args.delta
    options.update(profile_options(target, draft, args.tree, args.temperature))
    options["draft_temperature"] = draft_temperature(args, target, draft)
    return options


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
    from .engine import stream
    from .text import TextStream

    prompt = read_prompt(args)
    target, draft, tokenizer = load_pair(args)
    tree = tree_options(args, target, draft)
    prompt_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    run = stream(
        target, prompt_ids, draft, tokenizer=tokenizer, stop=args.stop, **tree, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
    )
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
            "time_s": s.time_s, "tree": args.tree, "budget": tree["budget"], "delta": tree["delta"],
            "draft_temperature": tree["draft_temperature"],
            "stats": s.to_dict(),
        }))
    else:
        print(f"\n[{s.new_tokens} tokens in {s.steps} steps: mean accepted length {s.mean_accepted_length:.2f}, "
              f"{s.tokens_per_second:.1f} tokens/s]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opttree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the shipped pair: OPT-Tree vs plain decoding on a few code prompts")
    add_decoding_args(demo)
    add_tree_args(demo)
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(func=lambda a: __import__("opttree.demo", fromlist=["run_demo"]).run_demo(a))

    gen = sub.add_parser("generate", help="generate text with speculative decoding")
    add_decoding_args(gen)
    add_tree_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text (a newline in bash: --prompt $'a\\nb')")
    prompt.add_argument("--prompt-file", help="read the prompt from this file ('-' = stdin), for multi-line prompts")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.set_defaults(func=cmd_generate)

    for module in ("opttree.train.cli", "opttree.bench.cli", "opttree.server"):
        try:
            __import__(module, fromlist=["register"]).register(sub)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
    return parser


def quiet_transformers() -> None:
    """No weight-loading progress bars on every command."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    threads.set_torch_threads()
    try:
        check_flags(args)
        quiet_transformers()
        return args.func(args) or 0
    except (ValueError, NotImplementedError, FileNotFoundError) as err:
        print(f"opttree: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
