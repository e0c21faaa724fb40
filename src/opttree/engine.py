"""The speculative decoding loop: draft -> verify -> accept -> compact -> emit (docs/USAGE.md, "How a step works")."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import torch
from transformers import Cache, PreTrainedModel
from transformers.generation.stopping_criteria import StopStringCriteria

from .arguments import eos_list, prompt_and_mask, spec_options
from .cache import (cache_argument, check_model, context_window, last_logits_only, new_cache, static_cache,
                    static_capacity, truncate)
from .certify import certify
from .chains import ChainVerifier, has_state, state_cache
from .config import SpecConfig
from .genconfig import Rules, config_defaults, prepare, shape_logits
from .depth import DepthControl, make_depth_control
from .device import PhaseClock, has_static_step, model_device, seeded_generator, synchronize
from .drafters import CheckedDrafter, Drafter, ModelDrafter
from .drafters.sources import (SourceContext, default_children, default_drafter, default_max_depth, make_sources,
                               source_names)
from .parallel import lockstep_for
from .policies import TreePolicy, make_policy
from .rope import rope_switch
from .sampling import PositionNoise
from .stats import GenerationStats
from .tree import DraftTree
from .verify import StepReadout, TreeVerifier, Verification, accept_path


_NO_TOKEN = torch.iinfo(torch.long).max  # a token id no vocabulary has


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # (1, prompt + new) long
    stats: GenerationStats

    @property
    def new_tokens(self) -> torch.Tensor:
        """(new,) the generated token ids only."""
        return self.sequences[0, self.sequences.shape[1] - self.stats.new_tokens :]


class Stopper:
    """Where an emitted chunk must end: EOS, a stop string, or max_new_tokens, at the exact token.

    Stop strings are matched by transformers' own StopStringCriteria, as `target.generate(stop_strings=...)`
    does: on the last tokens of the whole sequence (prompt included), a match must end in the newest
    token, and byte-level vocabularies compare bytes (U+FFFD never matches half a character)."""

    def __init__(self, max_new_tokens: int, eos_ids: Sequence[int], prompt: torch.Tensor, stop: Sequence[str] = (),
                 tokenizer=None):
        self.remaining = max_new_tokens
        self.eos = frozenset(eos_ids)
        self.stop = StopStringCriteria(tokenizer, list(stop)) if stop else None
        if self.stop is not None:
            # the W last tokens of the sequence, all transformers looks at; ids past the vocabulary (padding
            # while the sequence is shorter) never match, as transformers clamps them to a blank entry
            width = self.stop.maximum_token_len
            padding = torch.full((width,), _NO_TOKEN, dtype=torch.long)
            self.tail = torch.cat([padding, prompt.cpu()])[-width:]  # (W,)

    def cut(self, chunk: Sequence[int]) -> tuple[int, bool]:
        """The C accepted tokens + bonus, on the host -> (how many to emit, whether generation ends with them)."""
        end, hit = min(len(chunk), self.remaining), False
        first_eos = next((i for i, token in enumerate(chunk[:end]) if token in self.eos), None)
        if first_eos is not None:
            end, hit = first_eos + 1, True  # the EOS token itself is emitted, as transformers does
        if self.stop is not None:
            tokens = torch.tensor(chunk[:end], dtype=torch.long)  # (C,) on the host
            stop_end = self._stop_string_end(tokens)
            if stop_end is not None:
                end, hit = stop_end, True
            self.tail = torch.cat([self.tail, tokens[:end]])[-self.tail.shape[0] :]
        self.remaining -= end
        return end, hit or self.remaining == 0

    def _stop_string_end(self, tokens: torch.Tensor) -> int | None:
        """How many of the (C,) `tokens` to emit so that the last one completes a stop string; None if none does."""
        windows = torch.cat([self.tail, tokens]).unfold(0, self.tail.shape[0], 1)[1:]  # (C, W): the tail after each token
        hits = self.stop(windows, None).nonzero()
        return int(hits[0]) + 1 if hits.numel() else None


class Generation:
    """An iterator over emitted chunks (LongTensor (C,)); `.stats` and `.sequences` fill in as it runs."""

    def __init__(
        self,
        target: PreTrainedModel,
        input_ids: torch.Tensor,
        drafter: Drafter | None,
        policy: TreePolicy,
        config: SpecConfig,
        stopper: Stopper,
        processors: tuple = (),
        depth: DepthControl | None = None,
    ):
        self.target, self.drafter, self.policy, self.config, self.stopper = target, drafter, policy, config, stopper
        self.processors = processors  # the generation_config's logits processors, applied per node
        self.depth = depth or make_depth_control(config, target)  # how deep each step drafts
        self.drafter_reads = bool(getattr(drafter, "wants_hidden", False))  # a drafter that reads the target
        self.wants_hidden = self.drafter_reads or bool(getattr(self.depth, "wants_hidden", False))
        self.feature: torch.Tensor | None = None  # (H,) the target's last-layer state at the last token it ran
        self.device = model_device(target)  # every tensor of the loop lives here
        self.committed = input_ids.to(self.device)  # (T,) prompt + tokens emitted so far
        self.prompt_len = input_ids.shape[0]
        self.width = tree_width(config, policy)  # the static path's padded tree size
        self.stats = GenerationStats()
        self.observing = None  # the last step's (start, end) marks around the drafter's observe, not read yet
        # one forward over the tree under a tree mask, or (a model with state layers) a batch of chains
        stateful = has_state(target)
        self.verifier = ChainVerifier(target) if stateful else TreeVerifier(target, self.wants_hidden, self.width)
        if stateful and self.wants_hidden:
            raise ValueError("a drafter or depth control that reads the target's hidden states (head, early-exit, "
                             "predictor) does not combine with a target of recurrent / convolution state layers; "
                             "use a draft model or the train-free sources")
        self.rope_switch = rope_switch(target.config.get_text_config())  # LongRoPE's O (`opttree.rope`), or None
        self.long_keys = False  # the target's cache holds keys of LongRoPE's long factors
        self.lockstep = lockstep_for(target)  # a target sharded over ranks: they compare every step (`opttree.parallel`)

    def _settle_observing(self, phases: PhaseClock) -> float:
        """Seconds the last step spent observing (0 if none is pending), once the device has caught up."""
        marks, self.observing = self.observing, None
        return phases.seconds(*marks) if marks else 0.0

    @property
    def sequences(self) -> torch.Tensor:
        return self.committed[None]  # (1, T)

    def __iter__(self) -> Iterator[torch.Tensor]:
        device, stats = self.device, self.stats
        generator, phases = seeded_generator(self.config.seed, device), PhaseClock(device)
        noise = PositionNoise(generator, device)  # the sampled verifier's noise, by position
        start = _clock(device)
        # Inference mode is entered per step and never held across a yield: streams interleaved in
        # one thread stay independent, and the caller's code between chunks keeps its own grad mode.
        with torch.inference_mode():
            cache = self._prefill()
        stats.prefill_s = _clock(device) - start
        finished = False
        while not finished:
            with torch.inference_mode():
                chunk, finished, step = self._step(cache, generator, noise, phases)
            stats.time_s = time.perf_counter() - start  # the step has synchronised (its readout)
            try:
                yield chunk
            except GeneratorExit:  # the caller stopped early: sharded, the other ranks stop with us
                self._agree(step, stop=True)
                raise
            step, stopped = self._agree(step)
            finished = finished or stopped
            self.depth.observe(*step)  # (accepted, depth, draft_s, verify_s): how deep the next step drafts
        stats.time_s = _clock(device) - start
        stats.draft_s += self._settle_observing(phases)

    def _agree(self, step: tuple, stop: bool = False) -> tuple[tuple, bool]:
        """A target sharded over ranks: each rank checks that the others hold its tokens, takes rank 0's
        timings for the depth control, and learns whether one of them stopped (`opttree.parallel.Lockstep`).
        Returns (the step as the depth control observes it, whether some rank stopped)."""
        if self.lockstep is None:
            return step, False
        stopped, timings = self.lockstep.exchange(self.committed, step[2:], stop)
        return (*step[:2], *timings), stopped

    def _prefill(self) -> Cache:
        """The target's cache of committed[:-1] (the last committed token is the root); the drafter starts."""
        if self.config.static:
            cache = static_cache(self.target, static_rows(self.target, self.prompt_len + self.stopper.remaining,
                                                          self.width))
        else:
            cache = state_cache(self.target) if isinstance(self.verifier, ChainVerifier) else new_cache()
        if self.drafter is not None:
            self.drafter.start(self.committed)
        seed_rows = getattr(self.drafter, "prompt_rows", 0)  # a drafter that learns from the prompt's logits
        if self.prompt_len > 1:
            prefix = self.committed[:-1]
            positions = torch.arange(prefix.shape[0], device=self.device)
            rows = min(max(seed_rows, 1), prefix.shape[0])  # otherwise unused: one row is the least we can ask
            out = self.target(input_ids=prefix[None], position_ids=positions[None],
                              **{cache_argument(self.target): cache},
                              output_hidden_states=self.wants_hidden, **last_logits_only(self.target, rows))
            if seed_rows:
                self.drafter.seed(prefix[-rows:], out.logits[0, -rows:])  # (rows,), (rows, V)
            if self.drafter_reads:
                self.drafter.seed_hidden(tuple(h[0] for h in out.hidden_states))  # ((T - 1, H),) per layer
            if self.wants_hidden:
                self.feature = out.hidden_states[-1][0, -1]  # (H,)
            self.long_keys = self.rope_switch is not None and prefix.shape[0] > self.rope_switch
        if hasattr(self.drafter, "share_target_cache"):  # a self-drafter runs the target's first layers
            self.drafter.share_target_cache(cache)
        return cache

    def _follow_rope_switch(self, cache: Cache, depth_limit: int) -> int:
        """LongRoPE as its generate runs it (`opttree.rope`): below the switch O, no node reaches O; when the
        root reaches it, the cache is recomputed once with the long factors (one forward over the committed
        tokens, root included, so that its largest position is past O). Returns the step's depth limit."""
        root = self.committed.shape[0] - 1  # the root's position
        if root < self.rope_switch:
            return min(depth_limit, self.rope_switch - 1 - root)
        if not self.long_keys:
            truncate(cache, 0)
            self.target(input_ids=self.committed[None], position_ids=torch.arange(root + 1, device=self.device)[None],
                        **{cache_argument(self.target): cache}, **last_logits_only(self.target))
            truncate(cache, root)  # the root's row goes: the tree forward computes it again
            self.long_keys = True
        return depth_limit

    def _step(self, cache: Cache, generator: torch.Generator, noise: PositionNoise, phases: PhaseClock
              ) -> tuple[torch.Tensor, bool, tuple[int, int, float, float]]:
        """One speculative step; returns (the emitted chunk (C,), whether generation ends with it, what the
        depth control observes: (accepted, drafted depth, draft seconds, verify seconds))."""
        drafter, device = self.drafter, self.device
        prefix_len = self.committed.shape[0] - 1
        t0 = phases.mark()
        # 1. draft: no deeper than the tokens still wanted (the bonus is the last one)
        depth_limit = min(self.stopper.remaining - 1, self.depth.limit(self.committed[-1], self.feature)
                          or self.stopper.remaining)
        if self.rope_switch is not None:
            depth_limit = self._follow_rope_switch(cache, depth_limit)
        tree = self.policy.build(drafter, self.committed, depth_limit) if depth_limit else DraftTree.empty(device)
        tree = tree.to(device)  # a drafter may run on another device
        t1 = phases.mark()
        # 2. verify: one target forward over [root] + tree
        logits = self.verifier.logits(cache, self.committed[-1], tree, prefix_len)
        logits, hidden = logits if self.wants_hidden else (logits, None)  # (N+1, V), ((N+1, H),) per layer
        logits = shape_logits(self.processors, self.committed, tree, logits)  # as target.generate at each node
        t2 = phases.mark()
        # 3. accept: the longest branch the target agrees with, plus its bonus token; the step's one
        #    host sync reads what the host needs (how many were accepted, the emitted tokens, the depth)
        path, length, bonus = accept_path(tree, logits, self.config, generator, noise, prefix_len)  # (N,), (), ()
        readout = StepReadout.read(tree, path, length, bonus)
        accepted = path[: readout.accepted]  # (A,)
        emitted = torch.cat([tree.tokens[accepted], bonus.view(1)])  # (A + 1,) on the device
        # 4. compact both caches to the root + accepted path
        self.verifier.commit(cache, self.committed[-1], tree, accepted, prefix_len)
        # the readout waited for the marks so far, and for the previous step's observing: reading them stalls nothing
        draft_s, verify_s = phases.seconds(t0, t1) + self._settle_observing(phases), phases.seconds(t1, t2)
        t3 = phases.mark()
        result = Verification(self.committed[-1], tree, logits, accepted, bonus, hidden, readout)
        if drafter is not None:  # the drafter learns what the target did: its cache, its estimates
            drafter.observe(result)
        if self.wants_hidden:
            self.feature = result.accepted_hidden()[-1]  # (H,) at the last accepted token
        self.observing = (t3, phases.mark())  # read at the next readout (drafting = building the tree + observing)
        # 5. emit, cutting at EOS / stop string / max_new_tokens inside the chunk
        end, finished = self.stopper.cut(readout.emitted)
        chunk = emitted[:end]
        self.committed = torch.cat([self.committed, chunk])
        self.stats.draft_s += draft_s
        self.stats.verify_s += verify_s
        self.stats.observe_step(drafted=len(tree), accepted=readout.accepted, emitted=end)
        return chunk, finished, (readout.accepted, readout.depth, draft_s, verify_s)


def _clock(device: torch.device) -> float:
    """Wall time once the device's queued work is done."""
    synchronize(device)
    return time.perf_counter()


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
    `opttree.drafters.sources`). transformers' spellings `do_sample`, `max_length` and an all-ones
    `attention_mask` are understood; `input_ids` may be a BatchEncoding.

    The target's generation_config is honoured as `target.generate` honours it: its logits processors
    (repetition penalty, suppressed or bad words, minimum length, forced EOS, ...) are applied at every
    node, its EOS ids and stop strings stop generation, and its do_sample / temperature / top_k / top_p /
    max_new_tokens fill in the settings not passed here. `generation_config` replaces the target's and
    `logits_processor` adds processors, as generate's arguments of those names do. `rules` replaces
    that preparation (custom_generate passes what transformers prepared); `depth` replaces the depth
    control `depth_control` names (`opttree train length-predictor` records the steps with one)."""
    input_ids, mask = prompt_and_mask(input_ids)
    ids = _prompt_ids(input_ids, target)
    auto_depth = options.get("max_depth") is None
    options = {k: v for k, v in options.items() if not (k == "max_depth" and v is None)}
    options = spec_options(options, ids.shape[0], mask)
    generation_config = generation_config or target.generation_config
    config = SpecConfig(**{**config_defaults(generation_config, options), **options})
    if auto_depth:
        config = replace(config, max_depth=default_max_depth(config, draft is not None))
    policy = make_policy(config)
    if config.children != default_children(config, draft is not None, policy):
        config = replace(config, children=default_children(config, draft is not None, policy))
        policy = make_policy(config)
    max_len = ids.shape[0] + config.max_new_tokens
    _check_fits(target, "target", max_len)
    check_model(target, "target", max_len)
    static = _static_choice(target, config, policy, max_len)
    config = replace(config, static=static)
    rows = static_rows(target, max_len, tree_width(config, policy)) if static else max_len + config.budget + 1
    certify(target, "target", max_len, rows - max_len, static=static)  # rows: the keys a step spans
    if rules is None:
        eos = None if eos_token_id is None else eos_list(eos_token_id)
        rules = prepare(target, generation_config, ids, config, eos, _stop_strings(stop), tokenizer, logits_processor)
    drafter = None
    if policy.needs_drafter:
        spec = config.drafter or default_drafter(draft is not None, config.datastore is not None)
        config = replace(config, drafter=spec)
        drafter, policy = _sources(target, draft, policy, config, max_len)
    elif config.drafter is not None or config.datastore is not None:
        raise ValueError(f"tree={config.tree!r} drafts nothing: drafter={config.drafter!r} / datastore="
                         f"{config.datastore!r} do not apply")
    if rules.stop and tokenizer is None:
        raise ValueError("stop strings need the tokenizer: pass tokenizer=...")
    stopper = Stopper(config.max_new_tokens, rules.eos_token_id, ids, rules.stop, tokenizer)
    return Generation(target, ids, drafter, policy, config, stopper, rules.processors, depth)


def static_rows(target: PreTrainedModel, max_len: int, width: int) -> int:
    """The static cache's capacity for a generation of `max_len` tokens whose trees are padded to `width`
    (its last step's rows included): the keys every static-path forward spans."""
    return static_capacity(max_len + width, context_window(target))


def tree_width(config: SpecConfig, policy: TreePolicy) -> int:
    """The static path pads every tree to this many nodes: one verify shape per generation."""
    return config.budget if policy.needs_drafter else 0


def _static_choice(target: PreTrainedModel, config: SpecConfig, policy: TreePolicy, max_len: int) -> bool:
    """Whether this generation takes the static path (`use_static`). Asked for, it must be possible;
    chosen for the user, it is skipped where it is not certified exact (a local window shorter than the
    preallocated cache, for one) and for the early-exit source, which drafts on the target's own
    growing cache."""
    self_drafts = policy.needs_drafter and bool(config.drafter) and "early-exit" in source_names(config.drafter)
    if config.static and self_drafts:
        raise ValueError(f"static=True does not combine with drafter={config.drafter!r}: the early-exit source "
                         "drafts on the target's own growing cache, and the static path preallocates it; "
                         "use static=False")
    if has_state(target):
        if config.static:
            raise ValueError("static=True does not combine with a target of recurrent / convolution state layers: "
                             "they are verified as a batch of chains over transformers' own cache; use static=False")
        return False
    if config.static is not None:
        return config.static
    if self_drafts or not use_static(None, target):
        return False
    try:
        rows = static_rows(target, max_len, tree_width(config, policy))
        certify(target, "target", max_len, rows - max_len, static=True)
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


def _sources(target: PreTrainedModel, draft, policy: TreePolicy, config: SpecConfig, max_len: int):
    """(drafter, policy) for the drafter spec `config.drafter`: the draft model checked and wrapped, the
    sources combined (`opttree.drafters.sources`)."""
    vocab = _vocab_size(target)
    if isinstance(draft, PreTrainedModel):
        _check_vocab(target, draft)
        _check_fits(draft, "draft", max_len)
        check_model(draft, "draft", max_len)
        certify(draft, "draft", max_len, config.budget + 1)
        draft = ModelDrafter(draft, config.draft_temperature, vocab=vocab)
    elif draft is not None:
        if config.draft_temperature != 1:
            raise ValueError("draft_temperature applies to a draft model; a custom Drafter returns its own "
                             "log-probabilities (scale them there)")
        draft = CheckedDrafter(draft, vocab)
    return make_sources(config.drafter, policy, config, SourceContext(target, draft, config, vocab, model_device(target)))


def generate(target: PreTrainedModel, input_ids, draft=None, **kwargs) -> GenerationOutput:
    """Generate with speculative decoding; same output as `target.generate` (exactly, at temperature 0).

    Returns `.sequences` (1, prompt + new) and `.stats`. Arguments as for `stream`.
    """
    run = stream(target, input_ids, draft, **kwargs)
    for _ in run:
        pass
    return GenerationOutput(run.sequences, run.stats)


def _stop_strings(stop) -> list[str]:
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
    return stop


def _prompt_ids(input_ids, target: PreTrainedModel) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.numel() == 0:
        raise ValueError("empty prompt: input_ids must hold at least one token")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
    ids = ids.long()
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise NotImplementedError(f"batch size {ids.shape[0]}: opttree decodes one sequence at a time (batch 1)")
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
