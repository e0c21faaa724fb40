"""Settings -> a running generation: `Speculator` (a target and its draft with the tree settings checked
once) turns `Request`s (a prompt and its own sampling settings) into the rows of one `Generation`
(`opttree.engine`); `stream` and `generate` are its one-call forms."""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Iterator, Sequence

import torch
from transformers import PreTrainedModel

from .batch_sizing import BatchLatency, SizedBudget, batch_latency, length_lanes
from .certify import certify
from .device import has_static_step, model_device
from .engine import CHAINED, Generation, GenerationOutput, Row, Stopper, static_rows, tree_width
from .genconfig import Rules, config_defaults, prepare
from .grammar import Constraint
from .settings.arguments import eos_list, prompt_and_mask, spec_options
from .settings.config import SpecConfig
from .settings.declared import Declared, declared_by
from .settings.drafter_spec import default_drafter
from .step.cache import check_model, context_window, has_indexed_attention
from .step.chains import verified_as_chains
from .step.depth import DepthControl, make_depth_control
from .step.drafters import CheckedDrafter, Drafter, model_drafter
from .step.drafters.sources import MergedPolicy, SourceContext, default_children, default_max_depth, make_sources
from .step.policies import TreePolicy, make_policy
from .step.policies.batch import BatchBudget

BATCH_SHARING = ("sized", "rows")  # batch_budget's named ways for a batch's rows to share a step


@dataclass(frozen=True)
class Request:
    """One prompt to generate, with the settings that may differ from request to request (None: the
    speculator's, else the target's generation_config, else SpecConfig's defaults)."""

    prompt: object  # token ids: (T,), (1, T), a list of ints, or a mapping with "input_ids"
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = None  # stop strings (they need the speculator's tokenizer)
    logits_processor: object = None  # added to the generation_config's processors, as generate's argument
    output_logits: bool | None = None  # keep the raw logits of its new tokens (GenerationOutput.logits)
    eos_token_id: int | Sequence[int] | None = None  # its own end-of-sequence ids ([]: none), as generate's argument

    def settings(self) -> dict:
        """The SpecConfig fields this request sets."""
        names = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "output_logits")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class Speculator:
    """A target, its draft (a model, a `Drafter` or None: the train-free sources) and the tree settings
    (SpecConfig's fields, transformers' spellings `do_sample` / `max_length` too), checked once here;
    then `generate` / `stream` any number of requests, one at a time or several as one batch.

        speculator = opttree.Speculator(target, draft, budget=16)
        outs = speculator.generate([opttree.Request(ids1), opttree.Request(ids2, temperature=0.7, seed=3)])

    A batch verifies every row's tree in one target forward per step; each row is exactly what its
    request gives alone (greedy: `target.generate`; sampled: the same draws from its seed, unless its
    children are sampled from the recycling matrix, which learns from every row). `batch_budget`, how a
    batch's rows share the step: "sized" (the default when no `budget` is given): each greedy row drafts the budget
    that makes the batch's tokens per second largest on this machine, at most `budget`
    (`opttree.batch_sizing`: the first batch of a target times its forward once; a `SizedBudget` brings
    its own latency table), and a sampled row that joins with `row(request, reproducible=False)` decodes
    plainly on the steps where the batch is faster so; "rows" (the default
    with a `budget`): each row its `budget`; a number of nodes or a `policies.batch.BatchBudget`: one node
    budget a step for the whole batch (batch-level OPT-Tree)."""

    def __init__(self, target: PreTrainedModel, draft: PreTrainedModel | Drafter | None = None, *, tokenizer=None,
                 eos_token_id: int | Sequence[int] | None = None, generation_config=None,
                 batch_budget: int | BatchBudget | str | None = None, **options):
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        if batch_budget is None:
            batch_budget = "rows" if "budget" in options else "sized"
        if batch_budget not in BATCH_SHARING and (isinstance(batch_budget, bool) or not isinstance(
                batch_budget, (numbers.Integral, BatchBudget, SizedBudget))):
            raise TypeError(f"batch_budget is {' or '.join(map(repr, BATCH_SHARING))}, a SizedBudget, a number of "
                            f"nodes or a BatchBudget, got {batch_budget!r}")
        self.sized = batch_budget == "sized" or isinstance(batch_budget, SizedBudget)
        self.latency = batch_budget.latency if isinstance(batch_budget, SizedBudget) else None  # given, else timed
        self.batch_budget = BatchBudget(fixed=int(batch_budget)) if isinstance(batch_budget, numbers.Integral) \
            else batch_budget if isinstance(batch_budget, BatchBudget) else None
        self.eos = None if eos_token_id is None else eos_list(eos_token_id)
        self.generation_config = generation_config or target.generation_config
        self.options = options
        self.passed: set[tuple] = set()  # the checks passed (`_check`)
        self.config, policy = self._settings({}, prompt_len=None)  # every setting checked now, by name
        self.sized = self.sized and policy.needs_drafter

    def stream(self, requests: Request | Sequence[Request], *, rules: Rules | None = None,
               depth: DepthControl | None = None, attention_mask=None, joinable: bool = False
               ) -> Generation | LaneGenerations:
        """A `Generation`: chunks (C,) for one request, (row index, chunk) pairs for a list of them.
        `rules` (custom_generate's preparation) replaces every row's; `depth` (a depth control, which
        learns as it goes) applies to one request. `joinable`: a batch that other requests will join
        while it runs (`admit`), so even a list of one takes the path of several rows. A list whose prompts'
        lengths differ too much to share a batch (`batch_sizing.fits`: every row is padded to the longest)
        runs as several batches of similar lengths, stepped in turn (`LaneGenerations`)."""
        if isinstance(requests, (list, tuple)) and len(requests) > 1 and not joinable and attention_mask is None:
            lengths = [_prompt_ids(prompt_and_mask(request.prompt)[0], self.target).shape[0] for request in requests]
            lanes = length_lanes(lengths)
            if len(lanes) > 1:
                return LaneGenerations([(lane, self._stream([requests[i] for i in lane], rules, depth, None, False))
                                        for lane in lanes])
        return self._stream(requests, rules, depth, attention_mask, joinable)

    def _stream(self, requests: Request | Sequence[Request], rules: Rules | None, depth: DepthControl | None,
                attention_mask, joinable: bool) -> Generation:
        """`stream` as one `Generation`."""
        batch = isinstance(requests, (list, tuple))
        items = list(requests) if batch else [requests]
        if not items or not all(isinstance(item, Request) for item in items):
            raise TypeError("Speculator.stream / generate take an opttree.Request or a non-empty list of them")
        if batch and depth is not None:
            raise ValueError("depth= belongs to one sequence: pass a single prompt")
        if depth is not None and not isinstance(depth, Declared):  # a user's: its declarations read once, here
            depth = _UserDepth(depth)
        several = len(items) > 1 or joinable
        latency = self._latency(len(items)) if several else None
        budget = latency.sized_budget(len(items), self.config.budget) if latency is not None else None
        rows = [self._row(item, several, rules, depth, attention_mask, budget) for item in items]  # one: any path
        _, shape = rows[0]  # a batch takes the dynamic path, where each step pads the trees to the widest
        allocator = SizedBudget(latency) if latency is not None and joinable else self.batch_budget
        return Generation(self.target, [row for row, _ in rows], shape.width, shape.static, batch or joinable,
                          allocator=allocator)

    def admit(self, run: Generation, request: Request) -> int:
        """Continuous batching: `request` joins the running batch `run` (a `stream` of a list) between two
        of its steps; returns its row index (its chunks come as (index, chunk) pairs)."""
        return run.admit(self.row(request))

    def row(self, request: Request, reproducible: bool = True) -> Row:
        """`request`'s row, checked, for a batch it will join (`Generation.admit`): the dynamic path. Its
        own budget: a sized batch cuts its tree, each step, for the rows decoding then (`SizedBudget`).
        `reproducible=False` (a sampled request that named no seed, e.g. a server's): its draws may depend on
        the batch, so a sized batch may also let it decode plainly on the steps where that is faster."""
        return self._row(request, True, None, None, None, reproducible=reproducible)[0]

    def _latency(self, rows: int) -> BatchLatency | None:
        """This machine's batch latency table covering `rows` rows where this speculator sizes a batch's trees
        (`opttree.batch_sizing`); None where it does not (or nothing is timed)."""
        if not self.sized or verified_as_chains(self.target):  # chains: refused as a batch
            return None
        return self.latency or batch_latency(self.target, rows)

    def generate(self, requests: Request | Sequence[Request], **kwargs) -> GenerationOutput | list[GenerationOutput]:
        """Run `stream` to the end: one `GenerationOutput` per request (a list for a list, in the requests' order)."""
        return self.stream(requests, **kwargs).finish()

    def _check(self, check: Callable, *args, **kwargs) -> None:
        """Run one of the checks of a model against a generation's sizes, once per speculator and arguments:
        a check depends on the models (fixed for the speculator's life) and on its arguments alone."""
        key = (check, *(id(a) if isinstance(a, torch.nn.Module) else a for a in args), *sorted(kwargs.items()))
        if key not in self.passed:
            check(*args, **kwargs)
            self.passed.add(key)

    def _settings(self, request: dict, prompt_len: int | None, mask=None) -> tuple[SpecConfig, TreePolicy]:
        """The resolved settings of one request: the speculator's options, then the request's, then the
        generation_config's, then the defaults; max_depth and children by the drafter when not given."""
        options = {**self.options, **request}
        auto_depth = options.get("max_depth") is None
        options = {k: v for k, v in options.items() if not (k == "max_depth" and v is None)}
        if prompt_len is None:  # checked before any prompt: a max_length is resolved per request
            options.pop("max_length", None)
        options = spec_options(options, prompt_len or 1, mask)
        config = SpecConfig(**{**config_defaults(self.generation_config, options, prompt_len), **options})
        spec = config.drafter or default_drafter(self.draft is not None, config.datastore is not None)
        if auto_depth:
            config = replace(config, max_depth=default_max_depth(spec, config.budget))
        policy = make_policy(config)
        if config.children != default_children(config.children, spec, policy):
            config = replace(config, children=default_children(config.children, spec, policy))
            policy = make_policy(config)
        if not policy.needs_drafter and (config.drafter is not None or config.datastore is not None):
            raise ValueError(f"tree={config.tree!r} drafts nothing: drafter={config.drafter!r} / datastore="
                             f"{config.datastore!r} do not apply")
        if policy.needs_drafter and config.drafter is None:
            config = replace(config, drafter=spec)
        return config, policy

    def _row(self, request: Request, batch: bool, rules: Rules | None, depth: DepthControl | None, mask,
             budget: int | None = None, reproducible: bool = True) -> tuple[Row, "_Shape"]:
        """One request's row: its settings, policy, drafter and stop rule; `batch`: one of several rows
        (the dynamic path, unless static=True asks for a refusal); `budget`: the batch's sized one, for a greedy
        row (a sampled row keeps its own: the draws of its seed must not depend on what else is in the batch)."""
        target = self.target
        prompt, own_mask = prompt_and_mask(request.prompt)
        ids = _prompt_ids(prompt, target)
        mask = mask if own_mask is None else own_mask
        config, policy = self._settings(request.settings(), ids.shape[0], mask)
        if budget is not None and config.temperature == 0:  # a sampled row keeps its own: its draws stay its own
            config, policy = self._settings({**request.settings(), "budget": budget}, ids.shape[0], mask)
        max_len = ids.shape[0] + config.max_new_tokens
        self._check(_check_fits, target, "target", max_len)
        self._check(check_model, target, "target", max_len)
        static = bool(config.static) if batch else _static_choice(target, config, policy, max_len, self._check)
        config = replace(config, static=static)
        keys = static_rows(target, max_len, tree_width(config, policy)) if static else max_len + config.budget + 1
        self._check(certify, target, "target", max_len, keys - max_len, static=static)  # keys: what a step spans
        if rules is None:
            eos = self.eos if request.eos_token_id is None else eos_list(request.eos_token_id)
            rules = prepare(target, self.generation_config, ids, config, eos, _stop_strings(request.stop),
                            self.tokenizer, request.logits_processor)
        drafter = None
        if policy.needs_drafter:
            held = next((p for p in rules.processors if isinstance(p, Constraint)), None)  # a grammar to draft by
            drafter, policy = _sources(target, self.draft, policy, config, max_len, self._check, held)
        if rules.stop and self.tokenizer is None:
            raise ValueError("stop strings need the tokenizer: pass tokenizer=...")
        stopper = Stopper(config.max_new_tokens, rules.eos_token_id, ids, rules.stop, self.tokenizer, config.max_time)
        depth = depth or make_depth_control(config, target)  # how deep each step drafts
        # its tree may be sized for the batch (a sampled one only when its draws need not be reproducible)
        sized = self.sized and (config.temperature == 0 or not reproducible)
        # a greedy one is drafted at the size its batch cuts it to: its policy built for fewer nodes
        resize = partial(_policy_at, config, policy) if sized and config.temperature == 0 and drafter is not None \
            else None
        row = Row(ids, drafter, policy, config, stopper, rules.processors, depth, model_device(target), sized, resize)
        return row, _Shape(tree_width(config, policy), static)


@dataclass(frozen=True)
class _Shape:
    width: int  # the static path's padded tree size
    static: bool


class LaneGenerations:
    """One list of requests as several batches ("lanes") of similar prompt lengths (`batch_sizing.length_lanes`),
    each a `Generation`, stepped in turn (a step each a turn, as the server's lanes): an iterator of (request index,
    chunk) pairs, as one batch's; `.rows` and `finish()` in the requests' order."""

    def __init__(self, lanes: list[tuple[list[int], Generation]]):
        self.lanes = lanes  # (the requests' indices, their batch)

    @property
    def rows(self) -> list[Row]:
        by_index = {i: run.rows[b] for lane, run in self.lanes for b, i in enumerate(lane)}
        return [by_index[i] for i in range(len(by_index))]

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        running = list(self.lanes)
        while running:
            for lane, run in list(running):
                for b, chunk in run.step():  # one step of the lane's rows (its prefill first)
                    yield lane[b], chunk
                if not run.active:
                    running.remove((lane, run))

    def finish(self) -> list[GenerationOutput]:
        """Run to the end: one output per request, in their order."""
        for _ in self:
            pass
        return [row.output() for row in self.rows]


def stream(
    target: PreTrainedModel,
    input_ids,
    draft: PreTrainedModel | Drafter | None = None,
    *,
    tokenizer=None,
    eos_token_id: int | Sequence[int] | None = None,
    stop: str | Sequence[str] | None = None,
    logits_processor=None,
    generation_config=None,
    rules: Rules | None = None,
    depth: DepthControl | None = None,
    **options,
) -> Generation:
    """Speculative generation as an iterator of emitted token chunks. Options are `SpecConfig`'s
    fields (tree, drafter, budget, delta, max_depth, max_new_tokens, temperature, top_p, top_k, seed,
    draft_temperature, acceptance, datastore); draft_temperature applies when `draft` is a model;
    max_depth defaults to 8 with a draft model, else to the budget (see `default_max_depth`).
    Without a draft, the train-free sources draft (`drafter="recycling+lookup"`; see
    `opttree.step.drafters.sources`). transformers' spellings `do_sample`, `max_length` and an all-ones
    `attention_mask` are understood; `input_ids` may be a BatchEncoding.

    A batch: a list of prompts (each a 1-D sequence of ids, of any lengths), or a (B, T) tensor with
    B > 1 (its `attention_mask` marking left or right padding). The rows are verified together, one
    target forward per step, each exactly as it would be alone (its own drafter, tree, random stream
    seeded with `seed` + its row index, and stop rule); the generation then yields (row index, chunk) pairs.

    The target's generation_config is honoured as `target.generate` honours it: its logits processors
    (repetition penalty, suppressed or bad words, minimum length, forced EOS, ...) are applied at every
    node, its EOS ids and stop strings stop generation, and its do_sample / temperature / top_k / top_p /
    max_new_tokens fill in the settings not passed here. `generation_config` replaces the target's and
    `logits_processor` adds processors, as generate's arguments of those names do. `rules` replaces
    that preparation (custom_generate passes what transformers prepared); `depth` replaces the depth
    control `depth_control` names (`opttree train length-predictor` records the steps with one).
    The same as `Speculator(target, draft, ...).stream(Request(...))`."""
    speculator, requests, mask = _prepared(target, input_ids, draft, tokenizer, eos_token_id, stop, logits_processor,
                                           generation_config, options)
    return speculator.stream(requests, rules=rules, depth=depth, attention_mask=mask)


def _prepared(target, input_ids, draft, tokenizer, eos_token_id, stop, logits_processor, generation_config, options
              ) -> tuple[Speculator, Request | list[Request], torch.Tensor | None]:
    """`stream`'s and `generate`'s arguments as (speculator, the request or a list of them, one prompt's mask)."""
    copies = options.pop("num_return_sequences", None)
    if copies is None:  # (0 is the caller's, and refused below)
        copies = (generation_config or target.generation_config).num_return_sequences or 1
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"num_return_sequences must be an integer >= 1, got {copies!r}")
    input_ids, mask = _repeated(*prompt_and_mask(input_ids), copies)
    prompts, batch = _prompts(input_ids, mask, target)
    speculator = Speculator(target, draft, tokenizer=tokenizer, eos_token_id=eos_token_id,
                            generation_config=generation_config, **options)
    if copies > 1 and speculator.config.greedy:
        raise ValueError(f"num_return_sequences={copies} with greedy decoding: every sequence would be the same; "
                         "sample (do_sample=True or a temperature > 0), as generate asks too")
    # a batch's rows draw independently, as generate's do (its num_return_sequences copies of a prompt too): row i
    # is seeded with seed + i, so each is what its prompt gives alone with that seed
    seeds = [(speculator.config.seed + i) % 2**64 for i in range(len(prompts))] if batch else [None]
    requests = [Request(ids, seed=seed, stop=stop, logits_processor=logits_processor)
                for ids, seed in zip(prompts, seeds)]
    return speculator, requests if batch else requests[0], None if batch else mask


def generate(target: PreTrainedModel, input_ids, draft=None, *, tokenizer=None, eos_token_id=None, stop=None,
             logits_processor=None, generation_config=None, rules: Rules | None = None,
             depth: DepthControl | None = None, **options) -> GenerationOutput | list[GenerationOutput]:
    """Generate with speculative decoding; same output as `target.generate` (exactly, at temperature 0).

    Returns `.sequences` (1, prompt + new) and `.stats`; for a batch of prompts, a list of them, one
    per prompt in order (prompts of very different lengths run as several batches: `Speculator.generate`).
    Arguments as for `stream`.
    """
    speculator, requests, mask = _prepared(target, input_ids, draft, tokenizer, eos_token_id, stop, logits_processor,
                                           generation_config, options)
    return speculator.generate(requests, rules=rules, depth=depth, attention_mask=mask)


class _UserDepth(Declared):
    """A user's depth control, with its declarations (`Declared`) read where it enters."""

    def __init__(self, inner: DepthControl):
        self.limit, self.observe = inner.limit, inner.observe
        self.wants_hidden = declared_by(inner)["wants_hidden"]


def _static_choice(target: PreTrainedModel, config: SpecConfig, policy: TreePolicy, max_len: int,
                   check: Callable) -> bool:
    """Whether this generation takes the static path (`use_static`). Asked for, it must be possible;
    chosen for the user, it is skipped where it is not certified exact (a local window shorter than the
    preallocated cache, for one) and for the early-exit source, which drafts on the target's own
    growing cache."""
    self_drafts = policy.needs_drafter and config.drafter.drafts_on_target_cache
    if config.static and self_drafts:
        raise ValueError(f"static=True does not combine with drafter={config.drafter!r}: the early-exit source "
                         "drafts on the target's own growing cache, and the static path preallocates it; "
                         "use static=False")
    if verified_as_chains(target):
        if config.static:
            raise ValueError(f"static=True does not combine with {CHAINED}: it is verified as a batch of chains over "
                             "transformers' own cache; use static=False")
        return False
    if has_indexed_attention(target):
        if config.static:
            raise ValueError("static=True does not combine with indexed sparse attention: the static cache has no "
                             "buffer for the indexer's keys here; use static=False")
        return False
    if config.static is not None:
        return config.static
    if self_drafts or not use_static(None, target):
        return False
    try:
        rows = static_rows(target, max_len, tree_width(config, policy))
        check(certify, target, "target", max_len, rows - max_len, static=True)
    except NotImplementedError:
        return False
    return True


def use_static(static: bool | None, target: PreTrainedModel) -> bool:
    """Whether a generation takes the static path: as asked, else the environment's OPTTREE_STATIC
    (1 / 0: how the test suite runs it both ways), else where it measured faster: for a target with a
    compiled fixed-shape step (`compile_model`). Eager, the padding costs about what the preallocated
    cache saves (docs/BENCHMARKS.md, "Static shapes"). `_static_choice` adds what a generation allows."""
    if static is not None:
        return static
    forced = os.environ.get("OPTTREE_STATIC", "")
    if forced not in ("", "0", "1"):
        raise ValueError(f"OPTTREE_STATIC must be 1 or 0 (or unset), got {forced!r}")
    return forced == "1" if forced else has_static_step(target)


def _sources(target: PreTrainedModel, draft, policy: TreePolicy, config: SpecConfig, max_len: int, check: Callable,
             held: Constraint | None = None):
    """(drafter, policy) for the drafter spec `config.drafter`: the draft model checked (`check`: the
    speculator's, which runs each check once) and wrapped, the sources combined (`opttree.step.drafters.sources`);
    the first distribution source held to the request's grammar `held`, if any."""
    vocab = _vocab_size(target)
    if isinstance(draft, PreTrainedModel):
        check(_check_vocab, target, draft)
        check(_check_fits, draft, "draft", max_len)
        check(check_model, draft, "draft", max_len)
        check(certify, draft, "draft", max_len, config.budget + 1)
        # a static-path generation's draft with a compiled fixed-shape step (`compile_model(draft)`) drafts in
        # fixed shapes too, over a cache of the sequence and a step's slots (max_depth layers of `budget`)
        positions = max_len + config.max_depth * config.budget + 1 if config.static and has_static_step(draft) else 0
        draft = model_drafter(draft, config.draft_temperature, vocab=vocab, static_positions=positions,
                              max_depth=config.max_depth, window=config.draft_window)
    elif draft is not None:
        if config.draft_temperature != 1:
            raise ValueError("draft_temperature applies to a draft model; a custom Drafter returns its own "
                             "log-probabilities (scale them there)")
        draft = CheckedDrafter(draft, vocab)
    context = SourceContext(target, draft, config, vocab, model_device(target), held)
    return make_sources(config.drafter, policy, config, context)


def _policy_at(config: SpecConfig, policy: TreePolicy, budget: int) -> TreePolicy:
    """A row's `policy` as built for `budget` nodes (the steps its batch sizes its tree below its own budget):
    its settings' policy, merged with its other sources' tries as the row's is (`MergedPolicy`)."""
    resized = make_policy(replace(config, budget=budget))
    if isinstance(policy, MergedPolicy):
        return MergedPolicy(resized, budget, policy.max_depth, policy.prune)
    return resized


def _stop_strings(stop) -> list[str]:
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
    return stop


def _prompts(input_ids, mask, target: PreTrainedModel) -> tuple[list[torch.Tensor], bool]:
    """The prompt(s) as (T,) id tensors, and whether they are a batch: a list of several prompts, or a
    (B, T) tensor with B > 1 whose `mask` (if any) marks left or right padding. A list of one prompt is
    that prompt, as a (1, T) tensor is."""
    if isinstance(input_ids, (list, tuple)) and input_ids and not _is_id(input_ids[0]):
        if len(input_ids) == 1:
            return [_prompt_ids(input_ids[0], target)], False
        if mask is not None:
            raise ValueError("a list of prompts has no padding: pass attention_mask only with a (B, T) tensor")
        return [_prompt_ids(ids, target) for ids in input_ids], True
    ids = torch.as_tensor(input_ids)
    if ids.dim() != 2 or ids.shape[0] == 1:
        return [_prompt_ids(ids, target)], False
    if mask is None:
        return [_prompt_ids(row, target) for row in ids], True
    mask = torch.as_tensor(mask)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}")
    return [_prompt_ids(_unpadded(row, keep, b), target) for b, (row, keep) in enumerate(zip(ids, mask))], True


def _repeated(input_ids, mask, copies: int):
    """generate's num_return_sequences: each prompt `copies` times in a row (transformers' order), its mask with it."""
    if copies == 1:
        return input_ids, mask
    if isinstance(input_ids, (list, tuple)) and input_ids and not _is_id(input_ids[0]):  # a list of prompts
        return [prompt for prompt in input_ids for _ in range(copies)], mask
    ids = torch.as_tensor(input_ids)
    ids = ids.view(1, -1) if ids.dim() == 1 else ids  # (B, T)
    mask = None if mask is None else torch.as_tensor(mask).view(ids.shape).repeat_interleave(copies, dim=0)
    return ids.repeat_interleave(copies, dim=0), mask


def _is_id(value) -> bool:
    return isinstance(value, numbers.Integral) or (isinstance(value, torch.Tensor) and value.dim() == 0)


def _unpadded(row: torch.Tensor, keep: torch.Tensor, b: int) -> torch.Tensor:
    """(T,) ids and their (T,) attention mask -> the prompt's own tokens (the ones, which must be contiguous)."""
    where = keep.eq(1).nonzero().flatten().tolist()
    if not where or where[-1] - where[0] + 1 != len(where) or not bool((keep.eq(0) | keep.eq(1)).all()):
        raise ValueError(f"attention_mask row {b} must be ones over the prompt and zeros over padding on either side")
    return row[where[0] : where[-1] + 1]


def _prompt_ids(input_ids, target: PreTrainedModel) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.numel() == 0:
        raise ValueError("empty prompt: input_ids must hold at least one token")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
    ids = ids.long()
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"a prompt of a batch must be one sequence, got shape {tuple(ids.shape)}")
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must have shape (1, T) or (T,), got {tuple(ids.shape)}")
    vocab = _vocab_size(target)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab}), got min {int(ids.min())} max {int(ids.max())}")
    return ids


def _vocab_size(model: PreTrainedModel) -> int:
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.get_text_config().vocab_size


def _check_vocab(target: PreTrainedModel, draft: PreTrainedModel) -> None:
    """Sizes may differ by padding (Qwen2.5-7B / 0.5B: 152064 / 151936 rows over one tokenizer); the
    drafter then works over the target's ids. Only the models are known here, not the tokenizer's real
    size, so a difference up to 1/8 of the target's vocabulary is taken as padding."""
    vt, vd = _vocab_size(target), _vocab_size(draft)
    if abs(vt - vd) > vt // 8:
        raise ValueError(
            f"draft and target vocabularies differ by more than padding: target has {vt} tokens, draft has {vd} "
            f"(up to {vt // 8} rows apart is taken as padding); the draft must share the target's tokenizer"
        )


def _check_fits(model: PreTrainedModel, role: str, max_len: int) -> None:
    window = context_window(model)
    if window is not None and max_len > window:
        raise ValueError(
            f"prompt + max_new_tokens = {max_len} tokens exceeds the {role} model's context window of {window}"
        )
