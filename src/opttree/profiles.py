"""Calibration profiles (docs/BENCH_USAGE.md): where `opttree calibrate` saves what it measured for a
target/draft pair on this machine, and what the commands, the benchmark and `opttree.profile_options`
read back (budget, delta, draft temperature, Sequoia's acceptance vector).

A profile is keyed by both models' names, configurations and dtypes and by the hardware
(`profile_key`), and lives in the user cache (`profile_dir`). The shipped pair comes with the profile
of the reference machine (`SHIPPED_PROFILES`), used on hardware of the same kind until
`opttree calibrate` writes one for this machine. The measuring is in `opttree.calibration`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from functools import lru_cache
from pathlib import Path

from .hardware import describe, hardware_key
from .quantize import weight_kinds
from .settings.config import drafter_delta
from .settings.drafter_spec import DrafterSpec
from .shipped import MODELS_DIR, cache_root, shipped_location
from .step.policies import sequoia

PROFILE_VERSION = 2  # 2: draft temperature
SHIPPED_PROFILES = MODELS_DIR / "profiles"  # the shipped pair's profiles from the reference machine, {dtype}.json
DRAFT_TEMPERATURE_FIELD = "draft_temperature"  # {"greedy": float, "sampled": float}
# What sampling runs (measured at temperature 1): {"tree", "drafter", "drafter_budget", "delta", "why", ...}.
# A profile without it (the shipped one) gives sampling the greedy choice.
SAMPLED_FIELD = "recommended_sampled"
AUTO_ENV = "OPTTREE_AUTO_CALIBRATE"  # "0": nothing is measured on first use (calibration, batch latency)


def recommended(profile: dict, temperature: float) -> dict:
    """The profile's choice for greedy decoding (temperature 0) or for sampling."""
    return (profile.get(SAMPLED_FIELD) or profile["recommended"]) if temperature > 0 else profile["recommended"]


def measured_sources(profile: dict) -> bool:
    """Whether a profile holds what today's choices read: the draft sources measured against each other
    (greedy and sampled). The shipped bfloat16 profile predates them: it would pick the draft model where
    the train-free sources measured faster."""
    return "tree" in profile["recommended"] and SAMPLED_FIELD in profile


def profile_draft_temperature(profile: dict, temperature: float) -> float:
    """The draft temperature a profile holds for greedy decoding (temperature 0) or for sampling."""
    return float(profile[DRAFT_TEMPERATURE_FIELD]["greedy" if temperature == 0 else "sampled"])


def profile_key(target, draft) -> str:
    """A stable hash of both models' names, configurations and dtypes, and of the hardware
    (`opttree.hardware.hardware_key`): a profile from another machine kind is never found."""
    parts = [model_part(m) for m in (target, draft)] + [hardware_key(target.device)]
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def model_part(model) -> dict:
    part = {"name": model.config._name_or_path, "config": model.config.to_diff_dict(), "dtype": str(model.dtype)}
    kinds = weight_kinds(model)
    return {**part, "weights": kinds} if kinds else part  # quantized in memory: a model apart


def profile_dir() -> Path:
    """profiles/ in the user cache (`opttree.shipped.cache_root`)."""
    return cache_root() / "profiles"


def profile_path(target, draft) -> Path:
    return profile_dir() / f"{profile_key(target, draft)}.json"


def save_profile(profile: dict, out_dir: Path | None = None) -> list[Path]:
    """Write the profile to the user cache (where `auto_settings` looks) and to out_dir/profile.json."""
    paths = [profile_dir() / f"{profile['key']}.json"]
    if out_dir is not None:
        paths.append(Path(out_dir) / "profile.json")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(profile, indent=1) + "\n")
    return paths


def shipped_profile_path(target, draft) -> Path | None:
    """The reference machine's profile, if these are the shipped models at a dtype it was measured in."""
    def is_shipped(model, name):
        return Path(model.config._name_or_path).resolve() == shipped_location(name).resolve()

    path = SHIPPED_PROFILES / f"{str(target.dtype).removeprefix('torch.')}.json"
    quantized = weight_kinds(target) or weight_kinds(draft)
    if quantized or not (is_shipped(target, "target") and is_shipped(draft, "draft") and path.exists()):
        return None
    measured_on, here = json.loads(path.read_text()).get("hardware"), hardware_key(target.device)
    if measured_on != here:
        _note_once(f"opttree: the shipped calibration profile was measured on {describe(measured_on or {})}; "
                   f"this machine is {describe(here)}: not applied (run `opttree calibrate` for this one)")
        return None
    return path


@lru_cache(maxsize=None)
def _note_once(message: str) -> None:
    print(message, file=sys.stderr)


def find_profile(target, draft) -> Path | None:
    """This machine's profile for the pair, else the shipped one (shipped pair only), else None.
    A profile written by an older opttree is ignored, with a warning."""
    if draft is None:
        return None
    path = profile_path(target, draft)
    if path.exists():
        version = json.loads(path.read_text()).get("version")
        if version == PROFILE_VERSION:
            return path
        warnings.warn(f"ignoring calibration profile {path}: version {version}, this opttree needs version "
                      f"{PROFILE_VERSION}; run `opttree calibrate` again", stacklevel=2)
    return shipped_profile_path(target, draft)


def load_profile(target, draft) -> dict:
    if draft is None:
        raise ValueError("--budget auto needs a draft model: calibration profiles belong to a target/draft pair")
    path = find_profile(target, draft)
    if path is None:
        path = profile_path(target, draft)
        raise ValueError(
            f"no calibration profile for this target/draft pair ({target.dtype}) at {path}; "
            "run `opttree calibrate` with the same --target, --draft and --dtype first, or give --budget N"
        )
    profile = json.loads(path.read_text())
    if profile.get("version") != PROFILE_VERSION:
        raise ValueError(f"calibration profile {path} has version {profile.get('version')}, expected "
                         f"{PROFILE_VERSION}; run `opttree calibrate` again")
    return profile


def profile_options(target, draft, tree: str, temperature: float) -> dict:
    """The SpecConfig fields this pair's profile (`find_profile`) sets for a tree policy: the draft
    temperature, and the acceptance vector by draw rank (Sequoia's tree; when sampling, the p-hat of the
    sampled children of `opt` and `eagle2` too). {} without a profile (the defaults apply)."""
    if draft is None or find_profile(target, draft) is None:
        return {}
    profile = load_profile(target, draft)
    options = {"draft_temperature": profile_draft_temperature(profile, temperature)}
    vector = sequoia.profile_vector(profile, greedy=temperature == 0)
    if vector and (tree == "sequoia" or (temperature > 0 and tree in ("opt", "eagle2"))):
        options["acceptance"] = vector
    return options


def auto_settings(target, draft, drafter: DrafterSpec | None = None, temperature: float = 0.0) -> tuple[int, float]:
    """(budget, delta) recommended by `opttree calibrate` for this pair on this machine (`find_profile`) at
    this temperature; for `drafter`, the budget measured with it when that is the draft source the profile
    chose (for sampling: the budget of the sampled choice), and its delta (`config.drafter_delta`: the
    calibrated one is the draft model's)."""
    profile = load_profile(target, draft)
    greedy, chosen = profile["recommended"], recommended(profile, temperature)
    budget = chosen.get("drafter_budget") if drafter is not None and drafter == chosen.get("drafter") else None
    return int(budget or greedy["budget"]), drafter_delta(drafter, float(chosen.get("delta", greedy["delta"])))


def profile_sources(target, draft, temperature: float = 0.0) -> dict:
    """The tree and draft sources `opttree calibrate` measured fastest for this pair here at this temperature:
    {"tree": "opt" | "dyspec" | "ar", "drafter": spec or None, "why": ...}; {} for a profile without that
    measurement (the shipped one)."""
    chosen = recommended(load_profile(target, draft), temperature)
    if "tree" not in chosen:
        return {}
    return {"tree": chosen["tree"], "drafter": DrafterSpec.parse(chosen["drafter"]) if chosen["drafter"] else None,
            "why": chosen["why"]}


def calibrated_options(target, draft, tree: str = "opt", temperature: float = 0.0) -> dict:
    """Every setting this pair's calibration profile holds for decoding with the draft model, `tree` and
    `temperature`, ready for `opttree.generate(target, ids, draft, **options)`: budget, delta, draft
    temperature (and Sequoia's acceptance vector; for tree 'opt', the draft sources the profile measured
    fastest when they use the draft model, e.g. 'model+lookup', with the budget measured for them).
    Where the profile found that sources without the draft model (or plain decoding) beat it on this
    machine, the result is still the draft model's settings: the call passes the draft, and a source
    that does not use it refuses it (`opttree generate` follows that choice and leaves the draft out;
    without a draft, `opttree.generate(target, ids)` drafts with `recycling+lookup`).
    {} without a profile or a draft (the defaults apply). Exported as `opttree.profile_options`."""
    options = profile_options(target, draft, tree, temperature)
    if options:
        chosen = profile_sources(target, draft, temperature)
        drafter = chosen.get("drafter") if tree == chosen.get("tree", "opt") else None
        if drafter and not drafter.uses_draft_model:
            drafter = None  # measured without the draft model: not what a call with the draft can run
        options["budget"], options["delta"] = auto_settings(target, draft, drafter, temperature)
        if drafter:
            options["drafter"] = drafter
    return options
