"""The speculative decoding loop: draft -> verify -> accept -> compact -> emit (docs/USAGE.md, "How a step works")."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Protocol, Sequence

import torch
from transformers import Cache, PreTrainedModel
from transformers.generation.stopping_criteria import StopStringCriteria

from .batch_sizing import by_length
from .device import PhaseClock, host_tensor, model_device, seeded_generator, synchronize
from .genconfig import shape_logits
from .packed import PackedLinears, entered, packed_linears
from .parallel import lockstep_for
from .settings.config import SpecConfig
from .stats import GenerationStats, RowCost
from .step.cache import (
    cache_argument,
    context_window,
    last_logits_only,
    new_cache,
    select_rows,
    stack_rows,
    static_cache,
    static_capacity,
    truncate,
)
from .step.chains import ChainVerifier, state_cache, verified_as_chains
from .step.depth import DepthControl
from .step.drafters import Drafter
from .step.drafters.together import Round
from .step.lean import Rider, float32_attention, lean_forward
from .step.policies import TreePolicy
from .step.policies.rows import build_listed, listed_groups
from .step.rope import rope_switch
from .step.sampling import PositionNoise, warp_logits
from .step.tree import DraftTree
from .step.verify import HostMatch, StepReadout, TreeVerifier, Verification, accept_path, target_choice

_NO_TOKEN = torch.iinfo(torch.long).max  # a token id no vocabulary has


class Allocator(Protocol):
    """How a batch's rows share a step (`policies.batch.BatchBudget`, `batch_sizing.SizedBudget`)."""

    def nodes(self, costs: list[RowCost]) -> list[int | None]:
        """Before drafting: the most nodes each row drafts this step (0: it decodes plainly, with no tree; None:
        its own budget). A row that can draft fewer (`Row.resize`) drafts its tree at that size."""

    def __call__(self, trees: list[DraftTree], nodes: list[int | None]) -> list[DraftTree]:
        """After drafting: the trees the batch verifies (`nodes`: what `nodes` chose before drafting)."""


# Devices where each row drafts on its own even when its drafter could batch its forwards with the other rows'
# (`drafters.together`): on a CPU the rows' threads cost more than the batched forwards save. Measured on a
# 2-core bf16 Xeon (`scripts/draft_together.py`: shipped pair, draft model, budget 8, 16 HumanEval prompts): together
# ran 0.93x each row alone at 8 rows and 0.87x at 4 (docs/BENCHMARKS.md, "Batches sized for their rows"); with
# the rows' threads running their ops without OpenMP teams of their own (`threads.single_threaded_ops`), 0.95x.
DRAFT_ALONE_ON = frozenset({"cpu"})
MEASURED_AFTER = 2  # a row's drafting steps before its tokens and drafting time per step count (`Row.cost`)
CHAINED = ("a target verified as chains (recurrent / convolution state layers, or attention on key indices: ALiBi, "
           "GPT-Neo's local layers, positions from the cache length)")


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # (1, prompt + new) long
    stats: GenerationStats
    # (new, V) the target's raw logits that predicted each new token (`output_logits=True`; else None)
    logits: torch.Tensor | None = None
    # (new, V) those logits processed and warped as generate's scores are (`output_scores=True`; else None)
    scores: torch.Tensor | None = None

    @property
    def new_tokens(self) -> torch.Tensor:
        """(new,) the generated token ids only."""
        return self.sequences[0, self.sequences.shape[1] - self.stats.new_tokens :]


class Stopper:
    """Where an emitted chunk must end: EOS, a stop string, or max_new_tokens, at the exact token; past max_time, at
    the step's last token (a prefix of the untimed output, as `generate`'s own time limit cuts it).

    Stop strings are matched by transformers' own StopStringCriteria, as `target.generate(stop_strings=...)`
    does: on the last tokens of the whole sequence (prompt included), a match must end in the newest
    token, and byte-level vocabularies compare bytes (U+FFFD never matches half a character)."""

    clock = staticmethod(time.monotonic)  # max_time's clock

    def __init__(self, max_new_tokens: int, eos_ids: Sequence[int], prompt: torch.Tensor, stop: Sequence[str] = (),
                 tokenizer=None, max_time: float | None = None):
        self.remaining = max_new_tokens
        # generate's max_time: the step that ends past it ends the generation (timed from here, before the prefill)
        self.deadline = None if max_time is None else self.clock() + max_time
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
        return end, hit or self.remaining == 0 or (self.deadline is not None and self.clock() > self.deadline)

    def _stop_string_end(self, tokens: torch.Tensor) -> int | None:
        """How many of the (C,) `tokens` to emit so that the last one completes a stop string; None if none does."""
        windows = torch.cat([self.tail, tokens]).unfold(0, self.tail.shape[0], 1)[1:]  # (C, W): the tail after each token
        hits = self.stop(windows, None).nonzero()
        return int(hits[0]) + 1 if hits.numel() else None


class Row:
    """One sequence of a generation: its tokens, its drafter and tree policy, its settings, stop rule,
    random stream and statistics. A `Generation` steps one or more rows together."""

    def __init__(self, ids: torch.Tensor, drafter: Drafter | None, policy: TreePolicy, config: SpecConfig,
                 stopper: Stopper, processors: tuple, depth: DepthControl, device: torch.device, sized: bool = False,
                 resize: Callable[[int], TreePolicy] | None = None):
        self.drafter, self.policy, self.config, self.stopper, self.depth = drafter, policy, config, stopper, depth
        self.sized = sized  # its tree may be cut to the budget sized for the batch (`batch_sizing.SizedBudget`)
        # its policy as built for fewer nodes (budget -> policy), for the steps its batch sizes its tree below its own
        self.resize, self.resized = resize, {}
        self.plain_step = False  # this step it decodes plainly (its batch's allocator chose so), no tree
        self.plain_run = 0  # steps decoded plainly in a row, up to the last one
        self.drafted_steps, self.drafted_emitted, self.drafted_s = 0, 0, 0.0  # over its steps that drafted
        self.processors = processors  # the generation_config's logits processors, applied per node
        self.drafter_reads = drafter is not None and drafter.wants_hidden  # a drafter that reads the target
        self.wants_hidden = self.drafter_reads or depth.wants_hidden
        self.self_drafts = drafter is not None and drafter.reads_target_cache  # drafts on the target's cache
        self.committed = ids.to(device)  # (T,) prompt + tokens emitted so far
        self.prompt_len = ids.shape[0]
        self.stats = GenerationStats()
        self.generator = seeded_generator(config.seed, device)
        self.noise = PositionNoise(self.generator, device)  # the sampled verifier's noise, by position
        self.siblings: int | None = None  # the most sampled children of a node in its trees so far (None: none yet)
        self.feature: torch.Tensor | None = None  # (H,) the target's last-layer state at the last token it ran
        self.observing = []  # the last step's (start mark, end mark, its share) of its drafter's learning, unread
        self.finished = False
        self.began = 0.0  # perf_counter when its prefill began
        keeps = config.output_logits or config.output_scores
        self.kept_logits: list[torch.Tensor] | None = [] if keeps else None  # (C, V) a step's chunk's logits

    def output(self) -> GenerationOutput:
        """Its sequence, statistics and (where kept) the logits and scores of its new tokens."""
        if self.kept_logits is None:
            return GenerationOutput(self.committed[None], self.stats)
        logits = torch.cat(self.kept_logits).float() if self.kept_logits else torch.zeros(0, 0)  # float32, as theirs
        scores = None
        if self.config.output_scores:
            scores = torch.stack([self._scores(t, row) for t, row in enumerate(logits)]) if len(logits) else logits
        return GenerationOutput(self.committed[None], self.stats, logits if self.config.output_logits else None,
                                scores)

    def pop_logits(self) -> torch.Tensor:
        """(C, V) the raw logits of the tokens emitted since the last call (kept where `output_logits` asked them),
        no longer kept: a server's request reads them chunk by chunk."""
        logits = torch.cat(self.kept_logits) if self.kept_logits else torch.zeros(0, 0)
        self.kept_logits.clear()
        return logits

    def _scores(self, t: int, logits: torch.Tensor) -> torch.Tensor:
        """(V,) generate's score of the t-th new token: its raw logits through the processors, with its context (the
        sequence before it), then the warpers where it samples."""
        context = self.committed[: self.prompt_len + t][None]  # (1, T + t)
        scores = logits[None].to(self.committed.device, copy=True)  # (1, V): processors may write in place
        for processor in self.processors:
            scores = processor(context, scores)
        return scores[0] if self.config.greedy else warp_logits(scores[0], self.config.warp)

    @property
    def prefix_len(self) -> int:
        """Committed tokens in the target's cache: all but the last (the next step's root)."""
        return self.committed.shape[0] - 1

    def settle_observing(self, phases: PhaseClock) -> float:
        """Seconds the last step spent observing (0 if none is pending), once the device has caught up."""
        spans, self.observing = self.observing, []
        return sum(phases.seconds(start, end) * share for start, end, share in spans)

    def cost(self) -> RowCost:
        """What a drafting step of this row gives and costs, as measured on its own steps so far (from the
        MEASURED_AFTER-th: its sources start cold)."""
        steps = self.drafted_steps
        known = steps >= MEASURED_AFTER
        return RowCost(self.sized, self.config.temperature > 0, self.config.budget,
                       self.drafted_emitted / steps if known else None, 1e3 * self.drafted_s / steps if known else None,
                       self.plain_run)

    def draft(self, depth_cap: int | None, nodes: int | None = None) -> DraftTree:
        """1. This step's tree (`plan`)."""
        return self.build(self.plan(depth_cap, nodes))

    def build(self, plan: tuple[TreePolicy, int] | None) -> DraftTree:
        """The tree of a `plan`."""
        if plan is None:
            return DraftTree.empty(self.committed.device)
        policy, depth_limit = plan
        return policy.build(self.drafter, self.committed, depth_limit).to(self.committed.device)

    def plan(self, depth_cap: int | None, nodes: int | None = None) -> tuple[TreePolicy, int] | None:
        """How this step's tree is drafted: (the policy, the depth limit), None for no tree. No deeper than the tokens
        still wanted (the bonus is the last one) nor `depth_cap`; drafted for `nodes` nodes where its batch sizes it
        below its budget and its policy can be (`resize`)."""
        depth_limit = min(self.stopper.remaining - 1, self.depth.limit(self.committed[-1], self.feature)
                          or self.stopper.remaining)
        if depth_cap is not None:
            depth_limit = min(depth_limit, depth_cap)
        if not depth_limit or nodes == 0:
            return None
        policy = self.policy
        if nodes is not None and nodes < self.config.budget and self.resize is not None:
            if nodes not in self.resized:
                self.resized[nodes] = self.resize(nodes)
            policy = self.resized[nodes]
        return policy, depth_limit

    def accept(self, tree: DraftTree, logits: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | HostMatch:
        """3. The longest branch the target agrees with, plus its bonus token: (path (N,), length (), bonus ())
        on the device, or where it is a match of the tree against the target's choices, those choices, matched on
        the host after the step's read (`HostMatch`). logits: (N + 1, V) at [root] + nodes."""
        logits = shape_logits(self.processors, self.committed, tree, logits)  # as target.generate at each node
        choice = target_choice(tree, logits, self.config, self.generator, self.noise, self.prefix_len)
        if choice is not None:
            return HostMatch(choice)
        return accept_path(tree, logits, self.config, self.generator, self.noise, self.prefix_len, self.siblings)

    def learn(self, result: Verification, phases: PhaseClock) -> None:
        """The drafter learns what the target did (its cache, its estimates), after compaction."""
        start = phases.mark()
        if self.drafter is not None:
            self.drafter.observe(result)
        if self.wants_hidden:
            self.feature = result.accepted_hidden()[-1]  # (H,) at the last accepted token
        self.observing.append((start, phases.mark(), 1.0))  # read at the next readout (drafting = the tree + observing)

    def emit(self, emitted: torch.Tensor, readout: StepReadout, drafted: int, draft_s: float, verify_s: float,
             logits: torch.Tensor | None = None) -> tuple[torch.Tensor, bool, tuple[int, int, float, float]]:
        """5. Cut the (A + 1,) accepted tokens + bonus at EOS / stop string / max_new_tokens; returns (the
        emitted chunk (C,), whether the row ends with it, what its depth control observes). logits: (A + 1, V) the
        rows that predicted them, kept where the row keeps its logits."""
        end, finished = self.stopper.cut(readout.emitted)
        chunk = emitted[:end] if end < emitted.shape[0] else emitted
        if self.kept_logits is not None:
            self.kept_logits.append(logits[:end])
        if readout.siblings > (self.siblings or 0):  # rejection sampling tries this many from the next step on
            self.siblings = readout.siblings
        self.committed = torch.cat([self.committed, chunk])
        self.stats.draft_s += draft_s
        self.stats.verify_s += verify_s
        self.stats.observe_step(drafted=drafted, accepted=readout.accepted, emitted=end)
        self.plain_run = self.plain_run + 1 if self.plain_step else 0
        if not self.plain_step:
            self.drafted_steps += 1
            self.drafted_emitted += end
            self.drafted_s += draft_s
        return chunk, finished, (readout.accepted, readout.depth, draft_s, verify_s)


PADDING_LIMIT = 1.25  # a prefill of several prompts computes at most this many positions per real one


def prefill_groups(lengths: list[int]) -> list[list[int]]:
    """The indices of prompts of these lengths in groups that share a prefill: one prefill pads every prompt to
    its longest (and a short one next to a long one also asks for the logits of every position after its last
    `prompt_rows`), so prompts of very different lengths are prefilled apart. By length, shortest first; a group
    takes the next prompt while its padded positions (longest x count) stay within PADDING_LIMIT x its real ones."""
    return by_length(lengths, lambda group: max(group) * len(group) <= PADDING_LIMIT * sum(group))


def prefill(target: PreTrainedModel, cache: Cache, rows: list[Row], share: bool = False) -> None:
    """The target's cache of each row's committed[:-1] (the last committed token is the root), in one
    forward; each drafter starts, and hears the prompt's logits or hidden states if it asks for them.
    Several rows: their prefixes right-padded to the longest, at positions 0.. each. A row's tokens attend
    only to earlier positions of its own row, all real, so each row's keys, values and logits are what
    its forward alone gives; its padding lies after its end, where no tree mask reaches. `share`: rows with
    the same prompt (a request's n choices) prefill it once (`prompt_rider`)."""
    prompt = prompt_rider(rows, cache, share)
    if prompt is None:
        return
    states = prompt.alone(target, hidden=any(row.wants_hidden for row in rows))
    prompt.spread([row.prompt_len - 1 for row in rows])
    if states is not None and prompt.copies is not None:
        states = tuple(h[prompt.copies] for h in states)
    prompt_outputs(rows, prompt.logits, states)


def prompt_rider(rows: list[Row], cache: Cache, share: bool) -> Rider | None:
    """The rows' drafters start; their prefill as a rider into `cache`: (D, P) ids and positions, the last positions
    whose logits it keeps and, where rows share a prompt and `share` (a cache whose rows can be copied), each row's
    among the D distinct prompts prefilled (`Rider.copies`; else a row each). None when no row has a token to
    prefill."""
    for row in rows:
        if row.drafter is not None:
            row.drafter.start(row.committed)
    lengths = [row.prompt_len - 1 for row in rows]  # P_b
    longest = max(lengths)
    if longest == 0:
        return None
    copies = None
    if share and len(rows) > 1:  # rows of one prompt (n choices of a request): the first of them stands for all
        firsts: dict[tuple[int, ...], int] = {}
        copies = [firsts.setdefault(tuple(row.committed[:length].tolist()), len(firsts))
                  for row, length in zip(rows, lengths)]
        copies = copies if len(firsts) < len(rows) else None
    prefilled = rows if copies is None else [rows[copies.index(d)] for d in range(max(copies) + 1)]
    device = rows[0].committed.device
    ids = torch.zeros(len(prefilled), longest, dtype=torch.long, device=device)  # (D, P)
    for b, row in enumerate(prefilled):
        ids[b, : row.prompt_len - 1] = row.committed[: row.prompt_len - 1]
    seeds = [row.drafter.prompt_rows if row.drafter is not None else 0 for row in rows]  # rows of logits each wants
    wanted = max(longest - length + min(seed, length) for length, seed in zip(lengths, seeds))
    kept = max(wanted, 1)  # the last `kept` positions' logits (one at least: the least a model can be asked)
    positions = torch.arange(longest, device=device).expand(len(prefilled), -1)  # (D, P)
    return Rider(ids, positions, cache, kept, copies=copies)


def prompt_outputs(rows: list[Row], logits: torch.Tensor, hidden_states: tuple | None) -> None:
    """What the rows' drafters and depth controls hear of their prefill: logits (B, kept, V) at its last positions,
    and the model's hidden states where a row asks for them ((B, P, H) per layer)."""
    lengths = [row.prompt_len - 1 for row in rows]
    longest, kept = max(lengths), logits.shape[1]
    for b, (row, length) in enumerate(zip(rows, lengths)):
        seed = row.drafter.prompt_rows if row.drafter is not None else 0
        if seed and length:
            take = min(seed, length)
            end = kept - (longest - length)  # the row's last real position, in `logits`
            row.drafter.seed(row.committed[length - take:length], logits[b, end - take:end])  # (take,), (take, V)
        if row.drafter_reads and length:
            row.drafter.seed_hidden(tuple(h[b, :length] for h in hidden_states))  # ((P_b, H),) per layer
        if row.wants_hidden and length:
            row.feature = hidden_states[-1][b, length - 1]  # (H,)


class Generation:
    """An iterator over emitted chunks: LongTensor (C,) for one sequence, (row index, chunk) pairs for a
    batch of several (each row's chunks in order; rows that finish leave the batch). `.stats` and
    `.sequences` fill in as it runs (`.rows[b].stats` and `.rows[b].committed` for each row of a batch)."""

    def __init__(self, target: PreTrainedModel, rows: list[Row], width: int, static: bool, batch: bool = False,
                 allocator: Allocator | None = None, rows_room: int = 0):
        """`allocator`: several rows' trees -> the trees they verify, e.g. `policies.batch.BatchBudget`
        (one node budget for the whole batch) or `batch_sizing.SizedBudget` (each row's tree sized for the
        rows of the step); None: each row keeps its own tree. `rows_room`: the most rows it will run at once
        (continuous batching: the server's --max-batch): its cache keeps room for them, so that a row joining
        is written into it and the running rows stay where they are (`cache.stack_rows`)."""
        self.target, self.rows, self.static, self.allocator = target, rows, static, allocator
        self.rows_room = rows_room
        # the target's and the drafters' linear layers that run from packed weights during the steps and
        # prefills, where that applies (`opttree.packed`: the same outputs, sooner)
        self.packed = packs([target], rows)
        self.single = not batch  # one sequence, not a batch (of one or more)
        self.device = model_device(target)  # every tensor of the loop lives here
        self.width = width  # the static path's padded tree size
        self.wants_hidden = any(row.wants_hidden for row in rows)
        # one forward over the trees under tree masks, or (state layers, attention on key indices) a batch of chains
        chains = verified_as_chains(target)
        self.verifier = ChainVerifier(target) if chains else TreeVerifier(target, self.wants_hidden, width)
        if chains and self.wants_hidden:
            raise ValueError(f"a drafter or depth control that reads the target's hidden states (head, early-exit, "
                             f"predictor) does not combine with {CHAINED}; use a draft model or the train-free sources")
        self.rope_switch = rope_switch(target.config.get_text_config())  # LongRoPE's O (`opttree.step.rope`), or None
        self.long_keys = False  # the target's cache holds keys of LongRoPE's long factors
        self.lockstep = lockstep_for(target)  # a target sharded over ranks: they compare every step (`opttree.parallel`)
        if len(rows) > 1:
            check_batchable(self, rows)
        self.cache: Cache | None = None  # the target's cache: one row per running sequence, in `active` order
        self.active: list[int] = []  # the rows still running (indices into `rows`), in the cache's order
        # rows admitted while running, whose prompts ride the next step's forward: groups of rows and their rider (None:
        # nothing to prefill); then those that rode it, until seated in the cache
        self.pending: list[tuple[list[int], Rider | None]] = []
        self.boarded: list[tuple[list[int], Rider | None]] = []
        self.phases = PhaseClock(self.device)
        self.started = False  # the rows given at the start are prefilled (the first step is under way)
        self.ended = False  # every row has finished: nothing more runs

    @property
    def stats(self) -> GenerationStats:
        return self._one().stats

    @property
    def sequences(self) -> torch.Tensor:
        return self._one().committed[None]  # (1, T)

    def output(self) -> GenerationOutput:
        """The sequence's output so far: sequences, statistics, and the logits and scores where kept."""
        return self._one().output()

    @property
    def config(self) -> SpecConfig:
        """The settings as resolved for this sequence (defaults and generation_config filled in)."""
        return self._one().config

    @property
    def drafter(self) -> Drafter | None:
        return self._one().drafter

    def finish(self) -> GenerationOutput | list[GenerationOutput]:
        """Run to the end: the output of the sequence (a list, one per row, for a batch)."""
        for _ in self:
            pass
        outputs = [row.output() for row in self.rows]
        return outputs[0] if self.single else outputs

    def _one(self) -> Row:
        if not self.single:
            raise ValueError("a batch has one sequence and statistics per row: read .rows[b].committed / .rows[b].stats")
        return self.rows[0]

    def __iter__(self) -> Iterator:
        # Inference mode is entered per step and never held across a yield: streams interleaved in
        # one thread stay independent, and the caller's code between chunks keeps its own grad mode.
        self.begin()
        while self.active:
            running, results = self._advance()
            for b, (chunk, finished, step) in zip(running, results):
                try:
                    yield chunk if self.single else (b, chunk)
                except GeneratorExit:  # the caller stopped early: sharded, the other ranks stop with us
                    self._agree(step, stop=True)
                    raise
                self._settle(b, finished, step)
            self._leave()
        self.ended = True

    def step(self) -> list[tuple[int, torch.Tensor]]:
        """One step of every running row, for a caller that admits and cancels rows between steps (a
        server's scheduler): the (row index, chunk) pairs of the step; rows that finished with it have
        left the batch (`rows[b].finished`). An empty list once every row has finished (`ended`)."""
        self.begin()
        if not self.active:
            return []
        running, results = self._advance()
        for b, (_, finished, step) in zip(running, results):
            self._settle(b, finished, step)
        self._leave()
        return [(b, chunk) for b, (chunk, _, _) in zip(running, results)]

    def begin(self) -> None:
        """Prefill the rows given at the start (and those admitted before it), once; the first step
        does it otherwise. A caller that admits rows one by one calls it to see a prefill fail alone."""
        if not self.started:
            self.started = True
            with torch.inference_mode(), entered(self.packed):
                self._join(list(range(len(self.rows))))

    def _advance(self) -> tuple[list[int], list[tuple]]:
        """One step of the running rows (rows admitted from now on run from the next one): their indices
        and (chunk, finished, what the depth control observes) each."""
        running = list(self.active)
        with torch.inference_mode(), entered(self.packed):
            results = self._step(self.cache, [self.rows[b] for b in running], self.phases, self._board())
        now = time.perf_counter()  # the step has synchronised (its readout)
        for b in running:
            self.rows[b].stats.time_s = now - self.rows[b].began
        return running, results

    def _settle(self, b: int, finished: bool, step: tuple) -> None:
        """Row b after its chunk was taken: whether it ends, and what its depth control learns."""
        row = self.rows[b]
        step, stopped = self._agree(step)
        row.finished = row.finished or finished or stopped
        row.depth.observe(*step)  # (accepted, depth, draft_s, verify_s): how deep the next step drafts
        if row.finished:
            row.stats.time_s = _clock(self.device) - row.began
            row.stats.draft_s += row.settle_observing(self.phases)

    def admit(self, row: Row) -> int:
        """Continuous batching: `row` joins the batch between two steps, while the generation runs (or
        before it starts): prefilled, then stacked into the cache; its chunks follow as (index, chunk)
        pairs from the next step on. Returns its index in `.rows`."""
        return self.admit_all([row])[0]

    def admit_all(self, rows: list[Row]) -> list[int]:
        """`admit` for several rows at once, prefilled together in one forward. If that raises, none of
        them joins (the batch is as it was) and the error is raised."""
        if self.single:
            raise ValueError("one sequence does not admit others: start a batch (a list of prompts or requests)")
        if self.ended:
            raise ValueError("this batch has ended (every row finished): start a new one")
        check_batchable(self, [self.rows[b] for b in self.active] + rows)  # refused: they never join `rows`
        first = len(self.rows)
        self.rows += rows
        new = list(range(first, len(self.rows)))
        self.packed += [pack for pack in packs([], rows) if pack not in self.packed]  # before their prefill
        if self.started and self._rides(rows):  # running: their prefill rides the next step's forward
            try:
                pending = self._boarding(new)
            except BaseException:
                del self.rows[first:]
                raise
            self.pending += pending
        elif self.started:  # running: they join now; before the start, the first prefill takes them
            try:
                with torch.inference_mode(), entered(self.packed):
                    self._join(new)
            except BaseException:
                del self.rows[first:]
                raise
        if any(row.wants_hidden for row in rows) and not self.wants_hidden:
            self.wants_hidden = self.verifier.hidden = True
        return new

    def cancel(self, b: int) -> None:
        """Row b leaves the batch (a request cancelled between steps); the others go on."""
        self.rows[b].finished = True
        self._leave()

    def _rides(self, rows: list[Row]) -> bool:
        """Whether rows admitted now are prefilled in the next step's forward (`lean.Rider`: the weights read once
        for the step and the prompts, where a prefill of their own would stall every running row for a forward):
        while rows run, over the lean forward, for rows that hear no hidden states. `OPTTREE_RIDE=0`: never."""
        return os.environ.get("OPTTREE_RIDE", "1") != "0" and bool(self.active) and not self.static \
            and isinstance(self.verifier, TreeVerifier) and lean_forward(self.target, None) is not None \
            and not any(row.wants_hidden or row.drafter_reads for row in rows)

    def _boarding(self, new: list[int]) -> list[tuple[list[int], Rider | None]]:
        """Rows `new`, admitted, in groups of similar lengths (`prefill_groups`): their drafters start, and each group's
        prompts become a rider (into a cache of its own) of the next step's forward."""
        now = time.perf_counter()
        boarding = []
        for group in prefill_groups([self.rows[b].prompt_len for b in new]):
            rows = [new[i] for i in group]
            boarding.append((rows, prompt_rider([self.rows[b] for b in rows], self._new_cache(self.rows[rows[0]]),
                                                self.shares_prompts)))
        for b in new:
            self.rows[b].began = now
        return boarding

    def _board(self) -> tuple[Rider, ...]:
        """The pending groups with a row still wanted ride this step's forward (`boarded` until `_seat`)."""
        self.boarded = [(rows, rider) for rows, rider in self.pending if not all(self.rows[b].finished for b in rows)]
        self.pending = []
        return tuple(rider for _, rider in self.boarded if rider is not None)

    def _seat(self) -> None:
        """The rows that rode the last step join the running ones: their drafters hear their prompts' logits, their
        caches are stacked with the batch's; they step from the next step."""
        done, self.boarded = self.boarded, []
        parts = [] if self.cache is None else [(self.cache, [self.rows[b].prefix_len for b in self.active])]
        for rows, rider in done:
            if rider is not None:
                rider.spread([self.rows[b].prompt_len - 1 for b in rows])
                prompt_outputs([self.rows[b] for b in rows], rider.logits, None)
            parts.append((rider.cache if rider is not None else self._new_cache(self.rows[rows[0]]),
                          [self.rows[b].prefix_len for b in rows]))
        seated = [b for rows, _ in done for b in rows]
        self._stack(parts, seated)
        now = time.perf_counter()
        for b in seated:
            self.rows[b].stats.prefill_s = now - self.rows[b].began  # from its admission

    def _join(self, new: list[int]) -> None:
        """Rows `new` start: prefilled together, in groups of similar lengths (`prefill_groups`), into caches of
        their own, then one cache of all running rows (`_stack`)."""
        start = _clock(self.device)
        groups = [[new[i] for i in group] for group in prefill_groups([self.rows[b].prompt_len for b in new])]
        parts = [] if self.cache is None else [(self.cache, [self.rows[b].prefix_len for b in self.active])]
        for group in groups:
            cache = self._new_cache(self.rows[group[0]])  # several rows: the dynamic path (`check_batchable`)
            prefill(self.target, cache, [self.rows[b] for b in group], self.shares_prompts)
            parts.append((cache, [self.rows[b].prefix_len for b in group]))
        self._stack(parts, [b for group in groups for b in group])
        prefill_s = _clock(self.device) - start
        for b in new:
            self.rows[b].began, self.rows[b].stats.prefill_s = start, prefill_s

    def _stack(self, parts: list[tuple[Cache, list[int]]], new: list[int]) -> None:
        """One cache of the running rows and the rows `new` (`parts`: caches and their rows' lengths, the running
        rows' first), in that order (`stack_rows`)."""
        running = self.active + new
        positions = len(running) * max(self.rows[b].prefix_len + self.rows[b].stopper.remaining for b in running)
        attention = torch.float32 if self.float32_attention(running, positions) else None
        self.cache = parts[0][0] if len(parts) == 1 and attention is None else \
            stack_rows(parts, attention, self.rows_room)
        self.active += new
        row = self.rows[new[0]]
        if self.rope_switch is not None:  # one sequence (`check_batchable`)
            self.long_keys = row.prefix_len > self.rope_switch
        if row.self_drafts:  # a self-drafter runs the target's first layers (one sequence: `check_batchable`)
            row.drafter.share_target_cache(self.cache)

    def float32_attention(self, running: list[int], positions: int) -> bool:
        """Whether the running rows' cache is kept in float32 after the prefill (`lean.float32_attention`): where
        every later forward of the target is a lean one (not the static path, nor a self-drafter that runs the
        target's layers on its cache, nor a target sharded over ranks)."""
        return not self.static and self.lockstep is None and not any(self.rows[b].self_drafts for b in running) \
            and float32_attention(self.target, positions, len(running))

    def _leave(self) -> None:
        """Rows that finished leave the batch and its cache: they cost nothing more."""
        kept = [k for k, b in enumerate(self.active) if not self.rows[b].finished]
        if kept and len(kept) < len(self.active):
            with torch.inference_mode():
                select_rows(self.cache, kept, [self.rows[self.active[k]].prefix_len for k in kept])
        self.active = [self.active[k] for k in kept]
        if not self.active:  # (the cache still holds the rows that left: nothing of it is kept)
            self.cache = None
        if not self.active and not self.boarded and self.pending:  # no step left to ride: forwards of their own
            with torch.inference_mode(), entered(self.packed):
                for rider in self._board():
                    rider.alone(self.target)
        if self.boarded:  # the rows that rode the step (or their own forwards) join the running ones
            with torch.inference_mode(), entered(self.packed):
                self._seat()
        if not self.active:  # every row has finished: the batch has ended and admits no more
            self.ended = True

    def _agree(self, step: tuple, stop: bool = False) -> tuple[tuple, bool]:
        """A target sharded over ranks: each rank checks that the others hold its tokens, takes rank 0's
        timings for the depth control, and learns whether one of them stopped (`opttree.parallel.Lockstep`).
        Returns (the step as the depth control observes it, whether some rank stopped)."""
        if self.lockstep is None:
            return step, False
        stopped, timings = self.lockstep.exchange(self.rows[0].committed, step[2:], stop)
        return (*step[:2], *timings), stopped

    @property
    def shares_prompts(self) -> bool:
        """Whether rows with one prompt prefill it once (`prefill`): where their caches' rows are keys and values that
        copy (not the static path's preallocated caches, nor recurrent state)."""
        return not self.static and not isinstance(self.verifier, ChainVerifier)

    def _new_cache(self, row: Row) -> Cache:
        if self.static:
            return static_cache(self.target, static_rows(self.target, row.committed.shape[0] + row.stopper.remaining,
                                                         self.width))
        return state_cache(self.target) if isinstance(self.verifier, ChainVerifier) else new_cache(self.target)

    def _follow_rope_switch(self, cache: Cache, row: Row) -> int | None:
        """LongRoPE as its generate runs it (`opttree.step.rope`): below the switch O, no node reaches O; when the
        root reaches it, the cache is recomputed once with the long factors (one forward over the committed
        tokens, root included, so that its largest position is past O). Returns the step's depth cap."""
        root = row.prefix_len  # the root's position
        if root < self.rope_switch:
            return self.rope_switch - 1 - root
        if not self.long_keys:
            truncate(cache, 0)
            self.target(input_ids=row.committed[None], position_ids=torch.arange(root + 1, device=self.device)[None],
                        **{cache_argument(self.target): cache}, **last_logits_only(self.target))
            truncate(cache, root)  # the root's row goes: the tree forward computes it again
            self.long_keys = True
        return None

    def _draft(self, cache: Cache, rows: list[Row], nodes: list[int | None], phases: PhaseClock
               ) -> tuple[list[DraftTree], list[list[tuple]]]:
        """Every row's tree (at most `nodes[i]` nodes where its policy can be built for them), and the spans of its
        drafting (start mark, end mark, its share of that time).
        Rows whose drafters batch their forwards draft together when there are several (`drafters.together`:
        a thread each, one draft forward per round), except on DRAFT_ALONE_ON devices: they share one span. Rows whose
        trees are listed on the host through one lister grow them together (`policies.rows`), in a span they share."""
        caps = [self._follow_rope_switch(cache, row) if self.rope_switch is not None else None for row in rows]
        for i, row in enumerate(rows):  # a row that decodes plainly this step drafts nothing
            row.plain_step = nodes[i] == 0
        together = [i for i, row in enumerate(rows) if row.drafter is not None and row.drafter.forwards_together]
        together = together if len(together) > 1 and self.device.type not in DRAFT_ALONE_ON else []
        trees, spans = [None] * len(rows), [[] for _ in rows]
        plans = {}
        for i, row in enumerate(rows):
            if i not in together:
                start = phases.mark()
                plans[i] = row.plan(caps[i], nodes[i])
                spans[i].append((start, phases.mark(), 1.0))
        builds = {i: (plan[0], rows[i].drafter, rows[i].committed, plan[1]) for i, plan in plans.items() if plan}
        built_rows = list(builds)  # the row index of each build
        for group in listed_groups(list(builds.values())) if len(builds) > 1 else []:
            group = [built_rows[g] for g in group]
            start = phases.mark()
            built = build_listed([builds[i] for i in group])
            end = phases.mark()
            for i, tree in zip(group, built):
                trees[i] = tree.to(self.device)
                spans[i].append((start, end, 1 / len(group)))
        for i, plan in plans.items():
            if trees[i] is None:
                start = phases.mark()
                trees[i] = rows[i].build(plan)
                spans[i].append((start, phases.mark(), 1.0))
        if together:
            start = phases.mark()
            built = Round().run([partial(rows[i].draft, caps[i], nodes[i]) for i in together])
            end = phases.mark()
            for i, tree in zip(together, built):
                trees[i] = tree
                spans[i].append((start, end, 1 / len(together)))
        return trees, spans

    def _step(self, cache: Cache, rows: list[Row], phases: PhaseClock, riders: tuple[Rider, ...] = ()) -> list[tuple]:
        """One speculative step of every row; returns per row (the emitted chunk (C,), whether the row ends
        with it, what its depth control observes: (accepted, drafted depth, draft seconds, verify seconds)).
        `riders`: prompts of rows that join the batch, prefilled in the step's forward (`lean.Rider`)."""
        prefix_lens, roots = [row.prefix_len for row in rows], [row.committed[-1] for row in rows]
        # 1. draft: each row's tree, from its own drafter and policy, of the most nodes its batch gives it
        nodes = self.allocator.nodes([row.cost() for row in rows]) if self.allocator is not None and len(rows) > 1 \
            else [None] * len(rows)  # (one row drafts its own: its tree pays alone, or its settings chose plain)
        trees, spans = self._draft(cache, rows, nodes, phases)
        t_drafted = phases.mark()
        if self.allocator is not None:  # one node budget for the batch (its time shared by the rows' drafting)
            trees = self.allocator(trees, nodes)
        t_allocated = phases.mark()
        # 2. verify: one target forward over every row's [root] + tree
        outputs = self.verifier.logits(cache, roots, trees, prefix_lens, riders)
        t_verified = phases.mark()
        # 3. accept: per row, the longest branch the target agrees with plus its bonus; the step's one host
        #    sync reads what the host needs of every row (how many were accepted, the emitted tokens, the depth)
        logits, hidden = zip(*outputs) if self.wants_hidden else (outputs, [None] * len(rows))
        outcomes = [row.accept(tree, lg) for row, tree, lg in zip(rows, trees, logits)]  # a path or a HostMatch each
        readouts = StepReadout.read_rows(list(zip(trees, outcomes)))
        accepted, emitted, bonuses = zip(*(_accepted(tree, outcome, readout, self.device)
                                           for tree, outcome, readout in zip(trees, outcomes, readouts)))
        # 4. compact the target's cache to each row's root + accepted path
        firsts = [r.path == list(range(r.accepted)) for r in readouts]  # matched on the host: stays where it is
        self.verifier.commit(cache, roots, trees, accepted, prefix_lens, firsts)
        # the readout waited for the marks so far, and for the last step's observing: reading them stalls nothing
        verify_s = phases.seconds(t_allocated, t_verified)
        allocate_s = phases.seconds(t_drafted, t_allocated) / len(rows)
        results = []
        for i, (row, tree) in enumerate(zip(rows, trees)):
            draft_s = sum(phases.seconds(start, end) * share for start, end, share in spans[i]) + allocate_s \
                + row.settle_observing(phases)
            row.learn(Verification(roots[i], tree, logits[i], accepted[i], bonuses[i], hidden[i], readouts[i]), phases)
            # the rows of [root] + nodes that predicted the emitted tokens: the root's, then each accepted node's
            kept = logits[i][torch.cat([accepted[i].new_zeros(1), accepted[i] + 1])] if row.kept_logits is not None \
                else None  # (A + 1, V)
            results.append(row.emit(emitted[i], readouts[i], len(tree), draft_s, verify_s, kept))
        _learned_together(rows, phases)
        return results


def _learned_together(rows: list[Row], phases: PhaseClock) -> None:
    """The rows' drafters that learn together (`learns_together`) learn from the step, once each (rows that share a
    drafter's state, as Token Recycling's matrix, learn in its first call); the rows share the time."""
    learning = [row for row in rows if row.drafter is not None and row.drafter.learns_together]
    if not learning:
        return
    start = phases.mark()
    for drafter in {id(row.drafter): row.drafter for row in learning}.values():
        drafter.learned()
    span = (start, phases.mark(), 1 / len(learning))
    for row in learning:
        row.observing.append(span)


def _accepted(tree: DraftTree, outcome, readout: StepReadout, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row's accepted nodes (A,), emitted tokens (A + 1,) and bonus () on the device, from its acceptance (a path on
    the device, or a match made on the host) and the step's readout."""
    a = readout.accepted
    if readout.path is not None:  # matched on the host: one copy to the device
        both = host_tensor(readout.path + readout.emitted, device)  # (2A + 1,)
        return both[:a], both[a:], both[-1]
    path, _, bonus = outcome
    accepted = path[:a]
    return accepted, torch.cat([tree.tokens[accepted], bonus.view(1)]), bonus


def packs(models: list, rows: list[Row]) -> list[PackedLinears]:
    """The packed linears of `models` and of the networks the rows' drafters run (each once)."""
    networks = {id(net): net for net in [*models, *(net for row in rows if row.drafter is not None
                                                      for net in row.drafter.networks)]}
    return [pack for pack in map(packed_linears, networks.values()) if pack is not None]


def check_batchable(generation: Generation, rows: list[Row]) -> None:
    """What decodes one sequence at a time, refused for a batch with the reason."""
    why = []
    if isinstance(generation.verifier, ChainVerifier):
        why.append(f"{CHAINED} (verified as chains over its cache's batch axis)")
    if generation.rope_switch is not None:
        why.append("a LongRoPE target past its switch (its cache is recomputed when the sequence crosses it)")
    if generation.lockstep is not None:
        why.append("a target sharded over ranks (--tp)")
    if generation.static:
        why.append("the static path (static=True: one preallocated sequence)")
    if any(row.self_drafts for row in rows):
        why.append("the early-exit source (it drafts on the target's own cache)")
    if why:
        raise NotImplementedError(f"a batch of {len(rows)} prompts does not combine with {'; '.join(why)}: "
                                  "generate the prompts one at a time")


def _clock(device: torch.device) -> float:
    """Wall time once the device's queued work is done."""
    synchronize(device)
    return time.perf_counter()


def static_rows(target: PreTrainedModel, max_len: int, width: int) -> int:
    """The static cache's capacity for a generation of `max_len` tokens whose trees are padded to `width`
    (its last step's rows included): the keys every static-path forward spans."""
    return static_capacity(max_len + width, context_window(target))


def tree_width(config: SpecConfig, policy: TreePolicy) -> int:
    """The static path pads every tree to this many nodes: one verify shape per generation."""
    return config.budget if policy.needs_drafter else 0
