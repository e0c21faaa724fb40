"""The one configuration object of a generation call, validated once, up front."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .drafter_spec import DrafterSpec

# CPU defaults (2-core machine, the shipped pair): see docs/METHODS.md, "Choosing budget, delta, depth
# and draft temperature".
DEFAULT_BUDGET = 16
DEFAULT_DELTA = 0.1
DEFAULT_MAX_DEPTH = 8
SOURCE_TOKENS = 128  # new tokens a calibration run when it compares the draft sources (`opttree bench`'s length): the
# train-free sources' acceptance grows along a generation (recycling learns the target, lookup finds its repeats)
# Below this, logits / temperature overflow float32 for ordinary logit gaps: use 0 (greedy) instead.
MIN_TEMPERATURE = 1e-4
DEPTH_CONTROL_NAMES = ("delta", "fixed", "thompson", "predictor")  # opttree.step.depth.DEPTH_CONTROLS
# How a tree's children are chosen when sampling (temperature > 0): the draft's top-ranked tokens, verified
# by matching, or draws without replacement from the draft, verified by recursive rejection sampling.
# "auto": each policy's own choice (`opttree.step.policies.shapes.ChildPicker`). At temperature 0: top-ranked.
CHILDREN = ("auto", "top", "sampled")


def drafter_delta(drafter: DrafterSpec | None, calibrated: float) -> float:
    """The delta `drafter` drafts at, given the one a calibration chose with the draft model (`drafter` None: the
    draft model): that one where a draft layer costs a network's forward, DEFAULT_DELTA for train-free sources,
    whose layers cost no forward. (At the draft model's 0.6, lookup alone stops at depth 2: 2.13x plain
    decoding against 2.89x at 0.1 on held-out code, docs/BENCHMARKS.md.)"""
    return calibrated if drafter is None or drafter.runs_network else DEFAULT_DELTA


def check_acceptance(acc) -> tuple[float, ...]:
    """A positional acceptance vector: acc[k] = P(the (k+1)-th child is the accepted one)."""
    acc = tuple(float(a) for a in acc)
    if not acc or any(not 0 <= a <= 1 for a in acc) or sum(acc) > 1 + 1e-6:
        raise ValueError(f"an acceptance vector needs entries in [0, 1] summing to at most 1, got {list(acc)}")
    return acc


def check_budget(budget) -> int:
    """The one check of a node budget (SpecConfig's, --budget's, --budgets' entries)."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an integer >= 1 (draft nodes per step), got {budget!r}")
    return budget


def budget_arg(text: str) -> "int | str":
    """--budget / a --budgets entry: 'auto' (the calibrated budget) or a budget, checked as it is read."""
    if text == "auto":
        return text
    try:
        return check_budget(int(text))
    except ValueError:
        raise ValueError(f"budget must be an integer >= 1 or 'auto', got {text!r}") from None


@dataclass(frozen=True)
class Warp:
    """What plain sampling draws from: transformers' warpers, in `generate`'s order (temperature, top-h, top-k,
    top-p, min-p, typical, epsilon and eta cutoffs), each off at its neutral value. SpecConfig's fields of the same
    names, checked there; `SpecConfig.warp` makes one."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0  # 0 = off (no token is below 0 x the top probability)
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    top_h: float = 0.0  # 0 = off

    @property
    def filters(self) -> bool:
        """Whether any warper past the temperature can remove a token."""
        return bool(self.top_k) or self.top_p < 1 or self.transformers_own

    @property
    def transformers_own(self) -> bool:
        """Whether a warper is set that runs as transformers' own object (`opttree.step.sampling.hf_warpers`)."""
        return self.min_p > 0 or self.typical_p < 1 or self.epsilon_cutoff > 0 or self.eta_cutoff > 0 or self.top_h > 0

    @property
    def identity(self) -> bool:
        """Whether the warped distribution is the logits' own softmax."""
        return self.temperature == 1 and not self.filters


# transformers' other sampling warpers (`Warp`): name -> (lowest, highest, whether each end is allowed), as theirs check
WARPER_RANGES = {"min_p": (0.0, 1.0, True, True), "typical_p": (0.0, 1.0, False, True),
                 "epsilon_cutoff": (0.0, 1.0, True, False), "eta_cutoff": (0.0, 1.0, True, False),
                 "top_h": (0.0, 1.0, True, True)}


@dataclass(frozen=True)
class SpecConfig:
    tree: str = "opt"  # tree policy name (see opttree.step.policies.available())
    # draft sources, "model+lookup" parsed into a DrafterSpec (None: "model" with a draft, else "recycling+lookup")
    drafter: DrafterSpec | None = None
    datastore: str | None = None  # folder of `opttree datastore build`, for the `datastore` source
    head: str | None = None  # folder of `opttree train head`, for the `head` source
    early_exit: str | None = None  # folder of `opttree train early-exit`, for the `early-exit` source
    budget: int = DEFAULT_BUDGET  # draft nodes per step, root excluded
    delta: float = DEFAULT_DELTA  # OPT-Tree: stop deepening when E(A) grows by <= delta
    max_depth: int = DEFAULT_MAX_DEPTH  # draft layers at most
    max_new_tokens: int = 256
    max_time: float | None = None  # seconds: generation ends after the step that passes it (generate's max_time)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    # transformers' other sampling warpers, each off at its neutral value (`Warp`)
    min_p: float = 0.0
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    top_h: float = 0.0
    seed: int = 0
    acceptance: tuple[float, ...] | None = None  # by draw rank: sequoia, sampled children's p-hat (None: default)
    draft_temperature: float = 1.0  # the draft's logits are divided by it before any policy sees them (lossless)
    # committed positions the draft model attends to at most (its oldest dropped as it goes; lossless): None = the
    # window its config.json declares (`opttree.step.drafters.model.declared_window`), else all; 0 = all
    draft_window: int | None = None
    children: str = "auto"  # at temperature > 0: "top" | "sampled" | "auto" (CHILDREN)
    depth_control: str = "delta"  # how deep each step drafts: delta | fixed | thompson | predictor (opttree.step.depth)
    length_predictor: str | None = None  # folder of `opttree train length-predictor`, for depth_control="predictor"
    output_logits: bool = False  # keep the target's raw logits of every new token (GenerationOutput.logits)
    output_scores: bool = False  # ... and generate's scores of them (processed, warped: GenerationOutput.scores)
    # The static path: the target's tree forwards have one shape (the tree padded to the budget, keys over a
    # preallocated cache compacted in place), what torch.compile and CUDA graphs need (`opttree.compile_model`).
    # None = on for a target compiled by `compile_model`, else off (`opttree.speculator.use_static`)
    static: bool | None = None

    def __post_init__(self) -> None:
        check_budget(self.budget)
        if not 0 <= self.delta < 1:
            raise ValueError(f"delta must be in [0, 1) (expected tokens), got {self.delta!r}")
        if not isinstance(self.max_depth, int) or self.max_depth < 1:
            raise ValueError(f"max_depth must be an integer >= 1, got {self.max_depth!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.max_time is not None and not (isinstance(self.max_time, (int, float)) and not isinstance(
                self.max_time, bool) and 0 < self.max_time < float("inf")):  # NaN too
            raise ValueError(f"max_time must be a finite number of seconds > 0 (or None: no limit), "
                             f"got {self.max_time!r}")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < float("inf")):  # also rejects NaN
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, "
                             f"got {self.temperature!r}")
        if not (isinstance(self.seed, int) and 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        for name, (low, high, low_in, high_in) in WARPER_RANGES.items():
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            inside = number and (low < value or low_in and value == low) and (value < high or high_in and value == high)
            if not inside:
                raise ValueError(f"{name} must be in {'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
                                 f" ({Warp.__dataclass_fields__[name].default:g} = off), got {value!r}")
        if not (0 < self.draft_temperature < float("inf")):  # also rejects NaN
            raise ValueError(f"draft_temperature must be a finite number > 0, got {self.draft_temperature!r}")
        window = self.draft_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
            raise ValueError(f"draft_window must be an integer >= 0 (0: the whole context), got {self.draft_window!r}")
        if self.drafter is not None:  # parsed here, once: a DrafterSpec from here on
            object.__setattr__(self, "drafter", DrafterSpec.parse(self.drafter))
        if self.children not in CHILDREN:
            raise ValueError(f"children must be one of {', '.join(CHILDREN)}, got {self.children!r}")
        if self.depth_control not in DEPTH_CONTROL_NAMES:
            raise ValueError(f"depth_control must be one of {', '.join(DEPTH_CONTROL_NAMES)}, got {self.depth_control!r}")
        for name in ("output_logits", "output_scores"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.static is not None and not isinstance(self.static, bool):
            raise ValueError(f"static must be True, False or None (automatic), got {self.static!r}")
        if self.acceptance is not None:
            object.__setattr__(self, "acceptance", check_acceptance(self.acceptance))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @cached_property
    def warp(self) -> Warp:
        """What a sampled token is drawn from (its warpers; the temperature 1 where greedy), made once."""
        return Warp(self.temperature or 1.0, self.top_k, self.top_p, self.min_p, self.typical_p,
                    self.epsilon_cutoff, self.eta_cutoff, self.top_h)
