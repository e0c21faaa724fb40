"""What the commands share: the decoding and tree flags (`add_decoding_args`, `add_tree_args`), and
what they resolve to: the model pair on its device and dtype (`load_pair`) and the tree options,
from the flags and the pair's calibration profile (`tree_options`). Used by `opttree.cli` and the
commands it registers (`bench`, `calibrate`, `serve`), which import torch only after `opttree.cli`
has chosen the OpenMP wait policy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .settings import config as defaults
from .settings.config import CHILDREN, DEPTH_CONTROL_NAMES, budget_arg
from .settings.drafter_spec import DrafterSpec
from .settings.names import BUILTIN_POLICIES, BUILTIN_SOURCES, DTYPE_NAMES, QUANTIZATIONS, TRAINED_HELP, TRAINED_SOURCES

if TYPE_CHECKING:
    import torch

# Building the parsers imports no torch (`opttree --help` stays fast); the other functions import it lazily.


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, DTYPE_NAMES[name])


def checked_arg(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse `type` from a parser that raises ValueError: the flag's error keeps the parser's message."""

    def arg(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return arg


def add_decoding_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that decodes (kebab-case versions of SpecConfig's fields)."""
    parser.set_defaults(tp=False)  # `add_tp_arg` adds --tp to the commands that run sharded
    parser.add_argument("--target", help="target model directory (default: the shipped pair)")
    parser.add_argument("--draft", help="draft model directory (default: the shipped pair's draft)")
    parser.add_argument("--dtype", choices=["auto", *sorted(DTYPE_NAMES)], default="auto",
                        help="weights and activations; float32 is the exactness reference; 'auto': on a CPU, measures "
                        "which of bfloat16 / float32 makes a tree step faster on this machine (cached); on CUDA, "
                        "bfloat16 where the GPU supports it, without measuring (default: auto)")
    parser.add_argument("--draft-dtype", choices=sorted(DTYPE_NAMES), default=None,
                        help="the draft's dtype, if not --dtype (a tiny draft can be faster in float32)")
    parser.add_argument("--quantize", choices=sorted(QUANTIZATIONS), default=None,
                        help="quantize the target's linear layers' weights with torchao after loading: int8 (per "
                        "output channel) or int4 (groups of 32 inputs, or 16 / 8 where needed); the output is then that "
                        "quantized model's own greedy output (default: none)")
    parser.add_argument("--draft-quantize", choices=sorted(QUANTIZATIONS), default=None,
                        help="quantize the draft model too (default: none)")
    parser.add_argument("--device", default="auto", help="where the models run: cpu, cuda, cuda:1, mps, ... "
                        "('auto' = cuda when available, else cpu) (default: auto)")
    parser.add_argument("--draft-device", help="the draft's device, if not --device")
    parser.add_argument("--compile", action="store_true", help="torch.compile the models: the target's "
                        "fixed-shape step of the static path (once per budget; CUDA graphs on a GPU), the draft's "
                        "too on a GPU, its forward on a CPU; the first compiled generations took 29-180 s on a "
                        "2-core CPU (docs/USAGE.md), so it pays for long runs")
    parser.add_argument("--static", action=argparse.BooleanOptionalAction, default=None,
                        help="the static path: trees padded to the budget, a preallocated KV cache compacted in "
                        "place, one verify shape (default: on with --compile, else off)")
    parser.add_argument("--attn-implementation", choices=["sdpa", "eager"], default="sdpa",
                        help="attention kernels; eager for architectures without sdpa (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off (default: %(default)s)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the most likely "
                        "one's probability, after top-k and top-p; 0 = off (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")


def add_tree_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tree", help=f"tree policy: {', '.join(BUILTIN_POLICIES)} (default: opt; ar where `opttree "
                        "calibrate` measured that no draft source beats plain decoding on this machine)")
    parser.add_argument("--budget", type=checked_arg(budget_arg), help="draft nodes per step, or 'auto' for the "
                        "calibrated value (default: auto when the pair has a calibration profile, else "
                        f"{defaults.DEFAULT_BUDGET})")
    parser.add_argument("--delta", type=float, help="OPT-Tree: stop deepening when E(A) grows by <= delta "
                        f"(default: the calibrated one with --budget auto, else {defaults.DEFAULT_DELTA})")
    parser.add_argument("--max-depth", type=int, help=f"draft layers at most (default: {defaults.DEFAULT_MAX_DEPTH} with a "
                        "draft model, else the budget)")
    parser.add_argument("--depth-control", choices=DEPTH_CONTROL_NAMES,
                        help="how deep each step drafts: delta (the policy's own rule), fixed (max-depth layers "
                        "every step), thompson (EESD: a Beta posterior over acceptance, sampled each step), "
                        "predictor (AdaEAGLE: a trained network predicts the accepted length; needs "
                        "--length-predictor) (default: delta, or predictor with --length-predictor)")
    parser.add_argument("--children", choices=CHILDREN, default="auto",
                        help="at temperature > 0: children drawn from the draft and verified by rejection sampling "
                        "(sampled) or the draft's top-ranked tokens (top); auto: sampled for opt, eagle2, dyspec "
                        "and sequoia when a network drafts (model, head, early-exit) (default: auto)")
    add_length_predictor_arg(parser)
    add_drafter_arg(parser)
    add_draft_temperature_arg(parser)


def add_drafter_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", type=checked_arg(DrafterSpec.parse), help="draft sources joined by '+': "
                        f"{', '.join(BUILTIN_SOURCES)} (e.g. model+lookup) (default: model with a draft model, else recycling+lookup; "
                        "+datastore with --datastore; without 'model' the shipped draft is not loaded)")
    parser.add_argument("--datastore", help="a folder from `opttree datastore build`: retrieval from it (REST-style)")
    add_trained_part_args(parser, "; given alone it means --drafter {source}")


def add_trained_part_args(parser: argparse.ArgumentParser, note: str = "") -> None:
    """--head, --early-exit, ...: the folders of the parts TRAINED_SOURCES read."""
    for source, option in TRAINED_SOURCES.items():
        parser.add_argument(f"--{source}", dest=option, help=f"{TRAINED_HELP[source]} for the '{source}' source"
                            + note.format(source=source))


def uses_draft_model(args) -> bool:
    """Whether the --drafter spec drafts with a draft model (the default does when one is at hand)."""
    drafter = getattr(args, "drafter", None)
    if drafter is None and hasattr(args, "drafter"):  # bench has no --drafter: its methods name sources
        drafter = trained_source_given(args)  # --head alone means --drafter head
    return drafter is None or drafter.uses_draft_model


def add_length_predictor_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--length-predictor", help="a folder from `opttree train length-predictor`: AdaEAGLE's draft "
                        "length predictor, for the 'predictor' depth control")


def trained_source_given(args) -> DrafterSpec | None:
    """The first source whose trained part's folder is given (--head, --early-exit), as a spec, else None."""
    given = next((source for source, option in TRAINED_SOURCES.items() if getattr(args, option, None)), None)
    return None if given is None else DrafterSpec((given,))


def add_draft_temperature_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-temperature", type=float, help="divide the draft's logits by this before the "
                        "tree is built (p-hat calibration; lossless for any value > 0) (default: the pair's "
                        "calibration profile, else 1)")
    parser.add_argument("--draft-window", type=int, help="the draft model attends to at most this many of the last "
                        "positions (lossless; 0: all) (default: the window the draft's config.json declares, 256 for "
                        "the shipped draft, else all)")


def draft_temperature(args, target, draft) -> float:
    """--draft-temperature, else the value fitted by `opttree calibrate` for this pair, else 1."""
    from .profiles import profile_options

    if args.draft_temperature is not None:
        return args.draft_temperature
    return profile_options(target, draft, "opt", args.temperature).get("draft_temperature", 1.0)


def resolve_device(name: str) -> "torch.device":
    """--device -> a torch device that exists here; a clear error otherwise."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a torch device (e.g. cpu, cuda, cuda:1, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine (torch {torch.__version__})")
    return device


DTYPE_ROUNDS = 3  # --dtype auto's measurement: rounds over both dtypes, the median kept


def auto_dtype(target_path, draft_path, device: "torch.device", tokens: int = 9, draft_layers: int = 3) -> str:
    """--dtype auto: the dtype in which one tree step (a target forward over `tokens` tokens and
    `draft_layers` draft forwards) measures faster here; cached per model pair and hardware."""
    import torch

    from .demo import load_model
    from .hardware import choose_dtype, describe, forward_ms, hardware_key
    from .profiles import profile_dir

    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    key = json.dumps([str(Path(target_path).resolve()), str(draft_path and Path(draft_path).resolve()),
                      hardware_key(device), tokens, draft_layers], sort_keys=True)
    cache = profile_dir() / f"dtype-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    if cache.exists():
        return json.loads(cache.read_text())["dtype"]
    pairs = {name: (load_model(target_path, torch_dtype(name)).to(device),
                    draft_path and load_model(draft_path, torch_dtype(name)).to(device)) for name in ("bfloat16", "float32")}
    rounds = {name: [] for name in pairs}
    for _ in range(DTYPE_ROUNDS):  # interleaved, so that a machine's drift or a slow start falls on both
        for name, (target, draft) in pairs.items():
            rounds[name].append(forward_ms(target, tokens) + (draft_layers * forward_ms(draft, tokens - 1) if draft else 0))
    step_ms = {name: statistics.median(ms) for name, ms in rounds.items()}
    chosen = choose_dtype(step_ms, bf16_hardware=hardware_key(device).get("bf16_hardware", False))
    print(f"opttree: --dtype auto chose {chosen}: a tree step (target over {tokens} tokens + {draft_layers} draft "
          f"layers) measured {step_ms['bfloat16']:.1f} ms in bfloat16 and {step_ms['float32']:.1f} ms in float32 "
          f"on this machine ({describe(hardware_key(device))}); cached in {cache}", file=sys.stderr)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"dtype": chosen, "step_ms": step_ms, "key": json.loads(key)}) + "\n")
    return chosen


def check_model_dir(path, flag: str) -> None:
    """A clear error for a --target / --draft that is not a local model directory (before transformers
    would read it as a Hub repo id)."""
    folder = Path(path)
    if not folder.exists():
        raise ValueError(f"{flag} {path}: no such directory")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: is a file; pass the model's directory (with config.json and weights)")
    if not (folder / "config.json").exists() or not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ValueError(f"{flag} {path}: no model here (expected config.json and *.safetensors or *.bin weights)")


def add_tp_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", action="store_true",
                        help="shard the target over the ranks `torchrun --nproc-per-node K -m opttree ...` starts "
                        "(transformers' tensor parallelism; gloo on CPUs, NCCL on GPUs); the draft, the tree and "
                        "sampling run on every rank, only rank 0 prints, writes or serves (docs/USAGE.md#tensor-parallel-targets)")


def check_tp(args, target_path, device: "torch.device") -> None:
    """--tp: joins the ranks and refuses what does not combine with a sharded target, before loading."""
    from transformers import AutoConfig

    from . import parallel

    for flag, given in (("--quantize", args.quantize), ("--draft-quantize", args.draft_quantize),
                        ("--compile", args.compile)):
        if given:
            raise ValueError(f"--tp does not combine with {flag}: a sharded target runs eager, unquantized")
    parallel.start(device)
    parallel.check_plan(AutoConfig.from_pretrained(target_path, local_files_only=True), target_path)


def load_pair(args):
    """(target, draft, tokenizer) from --target / --draft, or the shipped pair; with --tp the target is
    sharded over the ranks (`opttree.parallel`)."""
    import torch
    from transformers import AutoTokenizer

    from .demo import demo_paths, load_model
    from .device import compile_model, model_device
    from .quantize import quantize

    if args.target is None:
        target_path, draft_path = demo_paths()
        draft_path = args.draft or (draft_path if uses_draft_model(args) else None)
    else:
        target_path, draft_path = args.target, args.draft
    check_model_dir(target_path, "--target")
    if draft_path:
        check_model_dir(draft_path, "--draft")
    device = resolve_device(args.device)
    draft_device = resolve_device(args.draft_device or args.device)
    if args.tp:
        check_tp(args, target_path, device)
    chosen = args.dtype
    if chosen == "auto" and args.tp:  # measuring would load the whole target on one rank: the rule instead
        chosen = "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    elif chosen == "auto":
        chosen = auto_dtype(target_path, draft_path, device)
    dtype, draft_dtype = torch_dtype(chosen), torch_dtype(args.draft_dtype or chosen)
    attn = getattr(args, "attn_implementation", "sdpa")
    if args.tp:  # transformers places each rank's shard (cuda:LOCAL_RANK on GPUs); the draft goes beside it
        target = load_model(target_path, dtype, attn, tp_plan="auto")
        draft_device = resolve_device(args.draft_device) if args.draft_device else model_device(target)
    else:
        target = load_model(target_path, dtype, attn).to(device)
    draft = load_model(draft_path, draft_dtype, attn).to(draft_device) if draft_path else None
    if args.quantize:
        target = quantize(target, args.quantize)
    if args.draft_quantize and draft is not None:
        draft = quantize(draft, args.draft_quantize)
    if args.compile:  # the fixed-shape steps of the static path, unless --no-static
        from .packed import packing_applies

        if packing_applies(target):  # compiled graphs run the plain kernels, not the packed weights
            print("opttree: --compile: this CPU runs linear layers from packed weights when eager, which "
                  "compiled steps do not; compiled measured slower on such a CPU (docs/USAGE.md, \"Static shapes "
                  "and compiled steps\")", file=sys.stderr)
        static = getattr(args, "static", None) is not False
        target = compile_model(target, static=static)
        # the draft's too on a GPU (its layers in CUDA graphs); on a CPU its dynamic-shape compile measured
        # faster (docs/BENCHMARKS.md, "Static shapes and compiled steps on the CPU")
        draft = draft and compile_model(draft, static=static and model_device(draft).type == "cuda")
    return target, draft, AutoTokenizer.from_pretrained(target_path)


def tree_options(args, target, draft) -> dict:
    """The SpecConfig fields of the tree flags. With a calibration profile for the pair (written by
    `opttree calibrate`, or shipped with the default pair), --budget defaults to 'auto': the budget and
    delta the profile recommends; its draft temperature and Sequoia vector apply too, and so do the draft
    sources it measured fastest (or plain decoding, when none paid). Flags given win."""
    from .profiles import auto_settings, find_profile, profile_options, profile_sources

    profiled = find_profile(target, draft) is not None
    budget = args.budget or ("auto" if profiled else defaults.DEFAULT_BUDGET)  # checked by argparse
    chosen = profile_sources(target, draft, args.temperature) if profiled and args.tree is None and args.drafter is None \
        else {}
    tree = args.tree or chosen.get("tree", "opt")  # the namespace keeps what was typed
    if chosen.get("tree") == "ar":
        when = "sampling" if args.temperature > 0 else "greedy decoding"
        print(f"opttree: plain decoding (--tree ar) for {when}: the calibration profile of this pair on this machine "
              f"says {chosen['why']}; pass --tree opt to draft anyway", file=sys.stderr)
    drafter = args.drafter or trained_source_given(args) or chosen.get("drafter")
    if drafter and args.datastore:
        drafter = drafter.plus("datastore")
    options = dict(tree=tree, drafter=drafter, datastore=args.datastore,
                   **{option: getattr(args, option) for option in TRAINED_SOURCES.values()},
                   depth_control=args.depth_control or ("predictor" if args.length_predictor else "delta"),
                   length_predictor=args.length_predictor, max_depth=args.max_depth, children=args.children,
                   delta=defaults.DEFAULT_DELTA, static=getattr(args, "static", None), draft_window=args.draft_window)
    if budget == "auto":
        options["budget"], options["delta"] = auto_settings(target, draft, drafter, args.temperature)
    else:
        options["budget"] = budget
    if args.delta is not None:
        options["delta"] = args.delta
    options.update(profile_options(target, draft, tree, args.temperature))
    options["draft_temperature"] = draft_temperature(args, target, draft)
    if drafter and not drafter.uses_draft_model:
        options["draft_temperature"] = 1.0  # no draft model drafts
    return options


def resolved_tree_options(args, target, draft) -> dict:
    """`tree_options`, checked to be the same on every rank under --tp (`opttree.parallel`)."""
    from .parallel import same_everywhere

    return same_everywhere(tree_options(args, target, draft), "tree settings")


def used_draft(options: dict, draft):
    """The draft model if the chosen draft sources use it (the default does), else None. `options`: the
    settings of a call (their drafter a DrafterSpec or its text, e.g. a server request's field)."""
    drafter = options.get("drafter")
    uses = drafter is None or DrafterSpec.parse(drafter).uses_draft_model
    return draft if options.get("tree") != "ar" and uses else None
