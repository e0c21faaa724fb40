"""Benchmark methods: a registry of small factories, each returning `run(prompt_ids) -> Run`.

- `ar` and every tree policy of `opttree.step.policies.available()` run through `opttree.generate`;
  `POLICY:DRAFTER` runs a policy over named draft sources (`opt:recycling+lookup`, `opt:model+lookup`).
- Peers run through transformers' own `generate`: `hf-assisted` (assisted generation with the same
  draft, the assistant's default schedule), `hf-assisted-heuristic` (schedule 'heuristic'),
  `hf-lookup` (prompt lookup decoding, 10 tokens) and `hf-ar` (transformers' plain decoding).

Every method is timed the same way: wall time around the one generate call, prefill included,
tokenization outside, under `torch.inference_mode()` (the engine uses it; it makes transformers'
generate ~15% faster on CPU, so the peers get it too). Steps of the HF peers are counted with a
forward pre-hook on the target.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..device import seconds_since
from ..settings.config import CHILDREN, DEFAULT_DELTA, DEPTH_CONTROL_NAMES, SpecConfig, drafter_delta
from ..settings.drafter_spec import DrafterSpec
from ..settings.names import TRAINED_SOURCES
from ..speculator import Request, Speculator
from ..step.cache import cache_argument
from ..step.policies import available, make_policy

HF_LOOKUP_TOKENS = 10  # prompt_lookup_num_tokens of hf-lookup


@dataclass(frozen=True)
class Settings:
    """What every method of one benchmark shares."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    delta: float = DEFAULT_DELTA  # tree policies, unless the method spec sets its own (`method_delta`)
    delta_given: bool = False  # --delta was given: numeric budgets run at it whatever their drafter
    max_depth: int | None = None  # None: 8 with a draft model, else the budget (engine default)
    eos_token_id: int | None = None
    draft_temperature: float = 1.0  # tree policies (the CLI passes the pair's calibrated one)
    draft_window: int | None = None  # tree policies with the draft model (None: its declared window)
    trained: dict = field(default_factory=dict)  # TRAINED_SOURCES' options: the folders of trained parts (head=...)
    static: bool | None = None  # opttree's static path (None: on for a target compiled with compile_model)


@dataclass(frozen=True)
class MethodSpec:
    """One column of the benchmark: a method name, with a budget (and delta) for tree policies."""

    name: str
    budget: int | None = None
    delta: float | None = None  # None: Settings.delta

    @property
    def label(self) -> str:
        if self.budget is None:
            return self.name
        return f"{self.name}@{self.budget}" + (f"/d{self.delta:g}" if self.delta is not None else "")


@dataclass
class Run:
    """One method on one prompt."""

    token_ids: list[int]  # new tokens only
    steps: int | None  # target forwards after which tokens were emitted; None if not observable
    accepted_histogram: list[int] | None  # [a] = steps that accepted a draft tokens (bonus excluded)
    time_s: float  # wall time of the generate call, prefill included
    draft_s: float | None = None  # opttree: time spent drafting (all sources) and verifying; None for peers
    verify_s: float | None = None
    row_budget: int | None = None  # opttree: the budget the row drafted (a batch's sized one, `batch_sizing`)


RunFn = Callable[[torch.Tensor], Run]  # prompt ids (1, T) -> Run; a list of them (one batch) -> [Run]
Factory = Callable[[object, object, Settings, MethodSpec], RunFn]  # (target, draft, settings, spec)


@dataclass(frozen=True)
class Method:
    make: Factory
    budgeted: bool  # runs once per --budgets value
    needs_draft: bool
    about: str
    # its compiled step costs more the first time it meets each sequence length (transformers' static
    # cache: the attention mask grows a position a step): the warm-up generates through every length
    warm_every_length: bool = False


# ---- opttree -------------------------------------------------------------------------------------


def method_delta(spec: MethodSpec, settings: Settings) -> float:
    """The delta a method drafts at, as `generate` would: --delta when given (numeric budgets), else the
    calibrated one ('auto' budgets bring theirs) where its drafter runs the draft model or another network,
    and the default for train-free sources (`config.drafter_delta`)."""
    if spec.delta is None and settings.delta_given:
        return settings.delta
    return drafter_delta(parse_tree_method(spec.name)[1], settings.delta if spec.delta is None else spec.delta)


def tree_method(target, draft, settings: Settings, spec: MethodSpec) -> RunFn:
    """A tree policy through `opttree.generate`; `POLICY:DRAFTER` names its draft sources (the draft model
    is passed only when they include `model`)."""
    from ..profiles import profile_options

    policy, drafter, depth_control, children = parse_tree_method(spec.name)
    if drafter and not drafter.uses_draft_model:
        draft = None  # a train-free drafter: no draft model, no draft temperature
    options = dict(
        tree=policy, drafter=drafter, max_depth=settings.max_depth, max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k, min_p=settings.min_p,
        seed=settings.seed,
        eos_token_id=settings.eos_token_id,
        delta=method_delta(spec, settings), depth_control=depth_control,
        children=children, static=settings.static,
    )
    for source, option in TRAINED_SOURCES.items():
        if drafter and source in drafter:
            options[option] = settings.trained.get(option)
    if depth_control == "predictor":
        options["length_predictor"] = settings.trained.get("length_predictor")
    if spec.budget is not None:
        options["budget"] = spec.budget
    options.update(profile_options(target, draft, policy, settings.temperature))
    options["draft_temperature"] = settings.draft_temperature if draft is not None else 1.0
    if draft is not None:
        options["draft_window"] = settings.draft_window

    # a budget from 'auto' (it brings its delta) is the one-sequence choice: a batch sizes its rows' trees,
    # as generate does without a budget (`opttree.batch_sizing`); a budget given is each row's
    sharing = "sized" if spec.delta is not None else "rows"
    speculator = Speculator(target, draft, batch_budget=sharing, **options)  # the settings, checked once

    def run(prompt_ids: torch.Tensor | list[torch.Tensor]) -> Run | list[Run]:
        batch = isinstance(prompt_ids, list)  # (1, T) prompts as one batch
        start = time.perf_counter()
        generation = speculator.stream([Request(ids) for ids in prompt_ids] if batch else [Request(prompt_ids)])
        outs = generation.finish()
        elapsed = seconds_since(start, target) / len(outs)  # a batch's rows: an equal share each
        runs = [Run(out.new_tokens.tolist(), out.stats.steps, list(out.stats.accepted_histogram), elapsed,
                    out.stats.draft_s, out.stats.verify_s, row.config.budget if spec.budget is not None else None)
                for out, row in zip(outs, generation.rows)]
        return runs if batch else runs[0]

    return run


# ---- transformers peers --------------------------------------------------------------------------


def hf_method(assistant: bool = False, schedule: str | None = None, lookup: int | None = None,
              compiled: bool = False) -> Factory:
    """A factory for `target.generate(...)`, with the draft as assistant and/or prompt lookup, or with
    transformers' static cache and its own `torch.compile` of the forward (`compiled`)."""

    def make(target, draft, settings: Settings, spec: MethodSpec) -> RunFn:
        kwargs = hf_sampling_kwargs(settings)
        if assistant:
            kwargs["assistant_model"] = draft
        if lookup is not None:
            kwargs["prompt_lookup_num_tokens"] = lookup

        def run(prompt_ids: torch.Tensor | list[torch.Tensor]) -> Run | list[Run]:
            if isinstance(prompt_ids, list):
                return run_batch(prompt_ids)
            prompt_len = prompt_ids.shape[1]
            if compiled:
                kwargs.update(compiled_kwargs(target, prompt_len + settings.max_new_tokens))
            with count_forwards(target) as cache_lens, assistant_schedule(draft if assistant else None, schedule):
                torch.manual_seed(settings.seed)
                start = time.perf_counter()
                with torch.inference_mode():
                    out = target.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), **kwargs)
                elapsed = seconds_since(start, target)
            emitted = emitted_per_step(cache_lens, prompt_len, out.shape[1])
            histogram = None if emitted is None else accepted_histogram([e - 1 for e in emitted])
            return Run(out[0, prompt_len:].tolist(), len(cache_lens) or None, histogram, elapsed)

        def run_batch(prompts: list[torch.Tensor]) -> list[Run]:
            """(1, T) prompts as one left-padded batch, as transformers takes one (plain decoding only: its
            assisted generation and prompt lookup take one sequence). Each run gets an equal share of the time."""
            if assistant or lookup is not None or compiled:
                raise ValueError(f"{spec.name} takes one prompt at a time (transformers refuses a batch): leave it "
                                 "out of a --batch run")
            width = max(ids.shape[1] for ids in prompts)
            pad = kwargs["pad_token_id"]
            ids = torch.stack([torch.cat([ids.new_full((width - ids.shape[1],), pad), ids[0]]) for ids in prompts])
            mask = torch.stack([torch.arange(width, device=ids.device) >= width - p.shape[1] for p in prompts]).long()
            torch.manual_seed(settings.seed)
            start = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(ids, attention_mask=mask, **kwargs)
            elapsed = seconds_since(start, target)
            return [Run(_until_eos(row[width:].tolist(), settings.eos_token_id), None, None, elapsed / len(prompts))
                    for row in out]

        return run

    return make


def _until_eos(tokens: list[int], eos: int | None) -> list[int]:
    """A batch row's new tokens up to its EOS (included); transformers pads the rest."""
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def compiled_kwargs(target, length: int) -> dict:
    """generate's arguments for its compiled static-cache path: a preallocated cache of the power-of-two
    bucket that holds `length` tokens (prompts of one bucket share the compiled graph, as opttree's static
    path does), compiled on any device (transformers compiles by itself only on accelerators)."""
    from transformers import CompileConfig

    from ..step.cache import context_window, static_capacity

    config = CompileConfig()
    config._compile_all_devices = True  # transformers' switch for compiling off CUDA / XPU
    return {"cache_implementation": "static", "cache_config": {"max_cache_len": static_capacity(length, context_window(target))},
            "compile_config": config}


def hf_sampling_kwargs(settings: Settings) -> dict:
    """transformers' generate arguments for the same decoding rule (top_k=0 is off in both)."""
    kwargs = dict(max_new_tokens=settings.max_new_tokens, eos_token_id=settings.eos_token_id,
                  pad_token_id=settings.eos_token_id if settings.eos_token_id is not None else 0)
    if settings.temperature == 0:
        return dict(kwargs, do_sample=False)
    return dict(kwargs, do_sample=True, temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                min_p=settings.min_p or None)  # None: transformers' "off" (its 0 would add a warper that drops nothing)


@contextmanager
def count_forwards(model) -> Iterator[list[int]]:
    """Collect the cache length before each forward of `model` (0 when it starts without a cache)."""
    cache_lens: list[int] = []
    name = cache_argument(model)  # generate() passes the cache by the name the forward takes

    def hook(module, args, kwargs):
        cache = kwargs.get(name)
        cache_lens.append(0 if cache is None else cache.get_seq_length())

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield cache_lens
    finally:
        handle.remove()


@contextmanager
def assistant_schedule(draft, schedule: str | None) -> Iterator[None]:
    """Set the assistant's `num_assistant_tokens_schedule` for one call, then restore it."""
    if draft is None or schedule is None:
        yield
        return
    config = draft.generation_config
    saved = config.num_assistant_tokens_schedule
    config.num_assistant_tokens_schedule = schedule
    try:
        yield
    finally:
        config.num_assistant_tokens_schedule = saved


def emitted_per_step(cache_lens: list[int], prompt_len: int, final_len: int) -> list[int] | None:
    """Tokens emitted by each target forward of a transformers generate call.

    The target's cache before forward i + 1 holds every committed token but the last (the bonus of
    step i, not yet run), so the committed length after step i is cache_lens[i + 1] + 1. Returns
    None if the counts are not consistent with that (e.g. another decoding loop).
    """
    if not cache_lens:
        return None
    committed = [prompt_len] + [length + 1 for length in cache_lens[1:]] + [final_len]
    emitted = [b - a for a, b in zip(committed, committed[1:])]
    return emitted if all(e >= 1 for e in emitted) else None


def accepted_histogram(accepted: list[int]) -> list[int]:
    """[a] = how many steps accepted a draft tokens."""
    histogram = [0] * (max(accepted, default=0) + 1)
    for a in accepted:
        histogram[a] += 1
    return histogram


# ---- the registry --------------------------------------------------------------------------------

PEERS: dict[str, Method] = {
    "hf-assisted": Method(hf_method(assistant=True), False, True,
                          "transformers assisted generation with the same draft, default schedule"),
    "hf-assisted-heuristic": Method(hf_method(assistant=True, schedule="heuristic"), False, True,
                                    "transformers assisted generation, num_assistant_tokens_schedule='heuristic'"),
    "hf-lookup": Method(hf_method(lookup=HF_LOOKUP_TOKENS), False, False,
                        f"transformers prompt lookup decoding, prompt_lookup_num_tokens={HF_LOOKUP_TOKENS}"),
    "hf-ar": Method(hf_method(), False, False, "transformers plain decoding (target.generate)"),
    "hf-compiled": Method(hf_method(compiled=True), False, False,
                          "transformers plain decoding with its static cache and torch.compile (compiled in the "
                          "warm-up, through every sequence length of each cache size)", warm_every_length=True),
}


def method_table() -> dict[str, Method]:
    """Every method the benchmark can run: the tree policies registered now, and the peers."""
    table = {}
    for name in available():
        needs_draft = make_policy(SpecConfig(tree=name)).needs_drafter
        about = "plain autoregressive decoding (opttree engine)" if name == "ar" else f"opttree tree policy {name!r}"
        table[name] = Method(tree_method, name != "ar", needs_draft, about)
    return table | PEERS


def parse_tree_method(name: str) -> tuple[str, DrafterSpec | None, str, str]:
    """'POLICY[:DRAFTER][/DEPTH_CONTROL][~CHILDREN]' -> (policy, drafter spec or None, depth control, children)."""
    name, _, children = name.partition("~")
    name, _, depth_control = name.partition("/")
    policy, _, drafter = name.partition(":")
    return policy, DrafterSpec.parse(drafter) if drafter else None, depth_control or "delta", children or "auto"


def find_method(name: str) -> Method:
    """A method of `method_table()`, or `POLICY:DRAFTER` (a tree policy over named draft sources:
    `opt:recycling+lookup`, `opt:model+lookup`), either with `/DEPTH_CONTROL` (`opt:model/thompson`);
    a clear error for anything else."""
    table = method_table()
    if name in table:
        return table[name]
    policy, drafter, depth_control, children = parse_tree_method(name)
    if policy in table and table[policy].budgeted and table[policy].make is tree_method and (
            drafter or "/" in name or "~" in name):
        if depth_control not in DEPTH_CONTROL_NAMES:
            raise ValueError(f"method {name!r}: unknown depth control {depth_control!r} (one of "
                             f"{', '.join(DEPTH_CONTROL_NAMES)})")
        if children not in CHILDREN:
            raise ValueError(f"method {name!r}: unknown children {children!r} (one of {', '.join(CHILDREN)})")
        needs_draft = table[policy].needs_draft if drafter is None else drafter.uses_draft_model
        sources = f" over draft sources {drafter!r}" if drafter else ""
        return Method(tree_method, True, needs_draft, f"opttree tree policy {policy!r}{sources}, depth control "
                      f"{depth_control}, children {children}")
    raise ValueError(f"unknown method {name!r}; available: {', '.join(table)} (or 'all'), and POLICY:DRAFTER for "
                     f"a tree policy over named draft sources, e.g. opt:recycling+lookup, with /DEPTH_CONTROL "
                     f"for a depth control other than delta, e.g. opt:model/thompson, and ~top / ~sampled for "
                     f"how children are chosen at temperature > 0, e.g. opt~top")


def check_names(names: list[str]) -> None:
    for name in names:
        find_method(name)


def expand_methods(names: list[str], budgets: list[tuple[int, float | None]],
                   budgets_of: Callable[[str], list[tuple[int, float | None]]] | None = None) -> list[MethodSpec]:
    """Method names -> specs: budgeted methods once per (budget, delta); `ar` first, always (the baseline).
    `budgets_of(name)`: a method's own (budget, delta) pairs, where they depend on its draft sources
    ('auto' brings the budget calibrated for them); default: `budgets` for every method."""
    check_names(names)
    if not budgets and any(find_method(n).budgeted for n in names):
        raise ValueError("tree policies need at least one budget (--budgets)")
    ordered = ["ar"] + [n for n in dict.fromkeys(names) if n != "ar"]
    specs = []
    for name in ordered:
        if find_method(name).budgeted:
            specs += [MethodSpec(name, budget, delta) for budget, delta in (budgets_of or (lambda _: budgets))(name)]
        else:
            specs.append(MethodSpec(name))
    return specs
