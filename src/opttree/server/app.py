"""The OpenAI-compatible HTTP app of `opttree serve` over the speculative engine (docs/USAGE.md, "Serving").

Requests decode together (continuous batching, `opttree.server.batcher`): up to `max_batch` rows in one
running batch, one target forward per step for all of them; the others wait their turn in arrival
order in a bounded queue (429 when it is full). A target sharded over ranks (`--tp`) runs one
request at a time, on all of them (`opttree.server.ranks`). Decoding runs outside the event loop,
which keeps answering; a streaming client that disconnects cancels its request at the next step. On
shutdown, requests in flight or queued get `grace` seconds to finish; then each ends with an error (an error event when
streaming, a 503 otherwise) and new requests get 503. Request fields are OpenAI's, each honoured or
refused with a 400 naming it; tree settings (`tree`, `budget`, `delta`, `max_depth`,
`draft_temperature`) may be given per request as extra fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator

import prometheus_client as prom
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from ..batch_sizing import SizedBudget
from ..engine import Allocator
from ..flags import used_draft
from ..genconfig import OutputPenalties
from ..grammar import Constraint, one_of
from ..settings.arguments import eos_list
from ..speculator import Request as GenerationRequest
from ..step.cache import context_window
from ..speculator import Speculator
from ..text import TextStream
from ..threads import release_openmp_threads
from .batcher import Batcher, BatchJob
from .logprobs import MAX_TOP_LOGPROBS, AnswerLogprobs, Chunk, chunk_of, joined, prompt_report
from .ranks import Call, Leader

TREE_FIELDS = ("tree", "budget", "delta", "max_depth", "draft_temperature")
MAX_STOP_CHARS = 256  # a stop string's matcher costs ~its length squared (transformers' StopStringCriteria)


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (`--max-budget`, `--max-tree-depth`), so that no request's
    step outgrows what the machine carries: a step drafts at most max_depth layers of at most
    max_budget nodes and verifies max_budget + 1 tokens."""

    max_budget: int = 64
    max_depth: int = 64

    @staticmethod
    def for_device(device_type: str, budget: int | None = None, max_depth: int | None = None) -> "Limits":
        """The defaults: 256 nodes on a GPU (a forward over a few hundred tokens costs about one token
        there), 64 on a CPU (where 65 tokens cost several plain steps); never below the server's own
        settings."""
        default = 256 if device_type == "cuda" else 64
        return Limits(max(default, budget or 0), max(Limits.max_depth, max_depth or 0))

    def check(self, req) -> None:
        """A 400 naming the limit for a request past it."""
        for name, value, limit, flag in (("budget", req.budget, self.max_budget, "--max-budget"),
                                         ("max_depth", req.max_depth, self.max_depth, "--max-tree-depth")):
            if value is not None and value > limit:
                raise OpenAIError(400, f"{name}={value} is past this server's limit of {limit} ({flag})", name)


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions; anything else is refused by name."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)  # OpenAI's default
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)  # vLLM's extra field: 0 or -1 = off
    min_p: float = Field(default=0.0, ge=0, le=1)  # vLLM's extra field: 0 = off
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(default=1, ge=1)  # choices: sampled ones decode as rows of their own
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)  # OpenAI's ranges
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0, le=10)  # vLLM's extra field (transformers' processor)
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit, -100 to 100 (OpenAI's)
    ignore_eos: bool = False  # vLLM's extra fields: decode past the model's end-of-sequence ids,
    stop_token_ids: list[int] | None = None  # ... and end at these ids too (kept in the answer, as vLLM's)
    # structured outputs: the answer held to a grammar. OpenAI's {"type": "text" | "json_object" | "json_schema"};
    response_format: dict | None = None
    guided_json: dict | str | None = None  # vLLM's extra fields (its older spelling) ...
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark, or GBNF
    structured_outputs: dict | None = None  # ... and its newer: {"json" | "regex" | "choice" | "grammar" | ...: ...}
    user: str | None = None
    # opttree's own extra fields: the tree settings of this request
    tree: str | None = None
    budget: int | None = None
    delta: float | None = None
    max_depth: int | None = None
    draft_temperature: float | None = None

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    _fills: int | None = PrivateAttr(default=None)  # chat's default: the tokens left in the context window

    @property
    def new_tokens(self) -> int:
        asked = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return asked if asked is not None else self._fills or 16  # OpenAI's default for completions

    def fill_window(self, prompt_len: int, window: int | None) -> None:
        """Where its default length is the rest of the context window (chat's), set it for a prompt this long."""

    def eos(self, default: list[int], vocab: int) -> list[int] | None:
        """Its end-of-sequence ids where it changes the model's (`default`; None: it does not)."""
        if not self.ignore_eos and not self.stop_token_ids:
            return None
        if any(not 0 <= t < vocab for t in self.stop_token_ids or []):
            raise OpenAIError(400, f"stop_token_ids are token ids, 0 to {vocab - 1}", "stop_token_ids")
        own = [] if self.ignore_eos else list(default)
        return own + [t for t in self.stop_token_ids or [] if t not in own]

    def grammar(self) -> str | None:
        """The grammar its answer is held to (None: none), from whichever of the fields asks for one."""
        asked = []  # (field, kind of grammar, its value), each a grammar asked for
        if self.response_format is not None:
            kind, spec = self.response_format.get("type"), self.response_format.get("json_schema")
            if kind == "json_schema" and not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict)):
                raise OpenAIError(400, 'response_format {"type": "json_schema"} needs "json_schema": {"name": ..., '
                                  '"schema": {...}}', "response_format")
            if kind not in ("text", "json_object", "json_schema"):
                raise OpenAIError(400, f"response_format type {kind!r}: one of text, json_object, json_schema",
                                  "response_format")
            asked += [("response_format", "json_object", True)] if kind == "json_object" else \
                [("response_format", "json_schema", spec["schema"])] if kind == "json_schema" else []
        for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "lark")):
            if getattr(self, name) is not None:
                asked.append((name, kind, getattr(self, name)))
        names = dict(json="json_schema", json_object="json_object", regex="regex", choice="choice", grammar="lark")
        unknown = [key for key in self.structured_outputs or {} if key not in names]
        if unknown:
            raise OpenAIError(400, f"structured_outputs {unknown}: this server takes {', '.join(names)}",
                              "structured_outputs")
        asked += [("structured_outputs", names[key], value) for key, value in (self.structured_outputs or {}).items()
                  if value is not None and value is not False]
        if len(asked) > 1:
            raise OpenAIError(400, f"one of {', '.join(name for name, _, _ in asked)}: an answer follows one grammar",
                              asked[1][0])
        if not asked:
            return None
        ((name, kind, value),) = asked
        if self.ignore_eos:
            raise OpenAIError(400, "ignore_eos with a grammar: an answer that completes its grammar ends with EOS",
                              "ignore_eos")
        try:
            return one_of(**{kind: value})
        except (ValueError, TypeError) as error:
            raise OpenAIError(400, str(error), name) from None

    def processors(self, prompt_len: int, vocab: int, constraint=None) -> LogitsProcessorList | None:
        """Its logit bias and penalties as logits processors (in vLLM's order), then its grammar's `constraint`,
        applied to every node as `generate` applies processors (None: none). `vocab`: the target's, which the biased
        token ids must be in."""
        processors = LogitsProcessorList()
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                if not 0 <= token < vocab or not -100 <= bias <= 100:
                    raise OpenAIError(400, f"logit_bias {{{token}: {bias}}}: token ids are 0 to {vocab - 1}, biases "
                                      "-100 to 100", "logit_bias")
            processors.append(SequenceBiasLogitsProcessor([[[token], bias] for token, bias in self.logit_bias.items()]))
        if self.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if self.presence_penalty or self.frequency_penalty:
            processors.append(OutputPenalties(prompt_len, self.presence_penalty, self.frequency_penalty))
        if constraint is not None:
            processors.append(constraint)
        return processors or None

    @property
    def prompts(self) -> list:
        """Its prompts (chat: one, its messages)."""
        return [None]

    @property
    def places(self) -> int:
        """The rows it takes in the queue: its prompts' rows."""
        return self.rows * len(self.prompts)

    @property
    def rows(self) -> int:
        """The rows it decodes: its `n` sampled choices, or one whose copies are its greedy choices (none where it
        asks no tokens: an echoed prompt scored alone)."""
        return 0 if self.new_tokens == 0 else self.n if self.temperature > 0 else 1

    @property
    def top_logprobs_asked(self) -> int | None:
        """The likeliest tokens to report at each new token with its log-probability; None: no log-probabilities."""
        return None

    def refuse_unsupported(self) -> None:
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise OpenAIError(400, "at most 4 stop sequences", "stop")
        if self.stop == "" or (isinstance(self.stop, list) and "" in self.stop):
            raise OpenAIError(400, "a stop sequence must not be empty", "stop")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop_list):
            raise OpenAIError(400, f"a stop sequence may be at most {MAX_STOP_CHARS} characters", "stop")


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt, or several (their choices one after another)
    max_tokens: int | None = Field(default=None, ge=0)  # 0 with echo: the prompt scored alone
    echo: bool = False  # the prompt's text (and its tokens' log-probabilities) before the answer
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # 0: the chosen tokens' alone

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        one = isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None  # text, or OpenAI's content parts (text ones only here)

    def template_fields(self) -> dict:
        """The message as the chat template reads it: content parts joined into one text (as vLLM joins them)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in self.content):
                raise OpenAIError(400, "a message's content parts must be text parts ({\"type\": \"text\", "
                                  "\"text\": ...}): this server's models read text only", "messages")
            message["content"] = "\n".join(part["text"] for part in self.content)
        return message


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def fill_window(self, prompt_len: int, window: int | None) -> None:
        """Without max_tokens, a chat answer may run to the end of the context window (as OpenAI's and vLLM's)."""
        if not (self.max_completion_tokens or self.max_tokens) and window:
            if prompt_len >= window:
                raise OpenAIError(400, f"the prompt ({prompt_len} tokens) fills the model's context window of "
                                  f"{window}", "messages")
            self._fills = window - prompt_len

    @property
    def top_logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


@dataclass
class Metrics:
    """Prometheus counters with vLLM's spec-decode names under the `opttree:` prefix."""

    registry: prom.CollectorRegistry = field(default_factory=prom.CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = prom.Counter("opttree:requests", "finished requests", ["endpoint", "status"], registry=r)
        self.drafts = prom.Counter("opttree:spec_decode_num_drafts", "target verification steps", registry=r)
        self.draft_tokens = prom.Counter("opttree:spec_decode_num_draft_tokens", "draft tokens verified", registry=r)
        self.accepted = prom.Counter("opttree:spec_decode_num_accepted_tokens", "draft tokens accepted", registry=r)
        self.per_pos = prom.Counter("opttree:spec_decode_num_accepted_tokens_per_pos",
                                    "steps whose accepted draft reached this position", ["position"], registry=r)
        self.generated = prom.Counter("opttree:generation_tokens", "tokens generated", registry=r)
        self.mal = prom.Gauge("opttree:spec_decode_mean_acceptance_length",
                              "new tokens per step, bonus included, over all requests", registry=r)
        self.latency = prom.Histogram("opttree:e2e_request_latency_seconds", "request latency", registry=r)
        self.waiting = prom.Gauge("opttree:num_requests_waiting", "requests queued or running", registry=r)
        self.running = prom.Gauge("opttree:num_requests_running", "requests decoding now (rows of the batch)",
                                  registry=r)
        self.lanes = prom.Gauge("opttree:num_batches_running", "batches decoding now, stepped in turn (requests of "
                                "very different lengths decode in batches of their own)", registry=r)
        self.step_tokens = prom.Histogram("opttree:iteration_tokens_total", "tokens emitted per step, all rows",
                                          buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.batch_rows = prom.Histogram("opttree:batch_size", "rows (requests) in a step's batch",
                                         buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.row_nodes = prom.Histogram("opttree:spec_decode_draft_nodes_per_request_step",
                                        "draft nodes one request sent to verification in one step",
                                        buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.queue_time = prom.Histogram("opttree:request_queue_time_seconds", "time a request waited for its turn",
                                         registry=r)
        self.prefill_time = prom.Histogram("opttree:request_prefill_time_seconds", "the prefill a request joined the "
                                           "batch with (requests that join together share one)", registry=r)
        self.step_time = prom.Histogram("opttree:iteration_seconds", "one step of a running batch, all its rows",
                                        buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28), registry=r)
        self._tokens = self._steps = 0

    def observe(self, stats) -> None:
        self.drafts.inc(stats.steps)
        self.draft_tokens.inc(stats.drafted_tokens)
        self.accepted.inc(stats.accepted_tokens)
        self.generated.inc(stats.new_tokens)
        for position in range(1, len(stats.accepted_histogram)):  # steps with more than `position - 1` accepted
            self.per_pos.labels(str(position - 1)).inc(sum(stats.accepted_histogram[position:]))
        self._tokens += stats.new_tokens
        self._steps += stats.steps
        self.mal.set(self._tokens / self._steps if self._steps else 0.0)

    def observe_step(self, rows: int, tokens: int, drafted: list[int], seconds: float) -> None:
        """One step of the batch (`Batcher`'s on_step): its rows, their tokens, each row's draft nodes, its time."""
        self.step_time.observe(seconds)
        self.batch_rows.observe(rows)
        self.step_tokens.observe(tokens)
        for nodes in drafted:
            self.row_nodes.observe(nodes)


class Server:
    """The models, the engine settings and the decoding: a running batch that requests join (`Batcher`),
    or with a sharded target one request at a time in arrival order (`Turns`)."""

    def __init__(self, target, draft, tokenizer, tree_options: dict, model_name: str, max_queue: int = 16,
                 sampled_options: dict | None = None, leader: Leader | None = None, limits: Limits = Limits(),
                 max_batch: int = 8, batch_budget: Allocator | None = None):
        """`tree_options`: the engine settings of greedy requests; `sampled_options` those of sampled ones
        (temperature > 0; default: the same), e.g. the calibration profile's choice for each (`cmd_serve`).
        The draft model is passed to a request's generation when its settings' draft sources use it.
        `leader`: a target sharded over ranks (`--tp`): every generation runs on all of them (`opttree.server.ranks`).
        `limits`: what one request's tree fields may ask. `max_batch`: rows decoding together at most;
        `batch_budget`: how they share a step (`opttree.server.batch_budget`), None: a tree each."""
        self.target, self.draft, self.tokenizer, self.leader, self.limits = target, draft, tokenizer, leader, limits
        self.tree_options, self.model_name, self.max_queue = tree_options, model_name, max_queue
        self.sampled_options = sampled_options or tree_options
        self.vocab = target.config.get_text_config().vocab_size  # the token ids a request's logit_bias may name
        self.window = context_window(target)  # a chat answer's default length: up to its end
        self.eos = eos_list(target.generation_config.eos_token_id)  # what a request's stop_token_ids add to
        self.metrics = Metrics()
        self.turns = Turns()  # sharded: one decoding at a time, in arrival order
        self.batcher = None if leader else Batcher(target, max_batch, self.metrics.observe_step, batch_budget)
        # sized trees: each step cuts a greedy request's tree for the requests decoding then (`SizedBudget`)
        self.sizing = batch_budget if isinstance(batch_budget, SizedBudget) else None
        self.speculators: dict[str, Speculator] = {}  # by settings: each checked once
        # a thread per admitted request (those waiting their turn block in it), so none waits for a thread
        self.threads = ThreadPoolExecutor(max_workers=max_queue + 4, thread_name_prefix="opttree-decode")
        self.pending = 0
        self.stopping = False  # shutdown has begun: new requests get 503
        self.expired = threading.Event()  # the shutdown grace is over: requests still running end now
        # the scheduler's thread decodes: the setup's thread (loading, calibration) lets its idle OpenMP
        # workers go, which would otherwise make the scheduler's sleep between ops (`release_openmp_threads`)
        release_openmp_threads()

    def begin_shutdown(self, grace: float) -> None:
        """Refuse new requests; let those in flight or queued finish for `grace` seconds, then end them."""
        if not self.stopping:
            self.stopping = True
            timer = threading.Timer(grace, self.expired.set)
            timer.daemon = True
            timer.start()

    def prompt_ids(self, req, prompt: str | list[int] | None = None) -> list[int]:
        """The token ids of a chat request's messages, or of one of a completion request's prompts."""
        if isinstance(req, ChatRequest):
            if not getattr(self.tokenizer, "chat_template", None):
                raise OpenAIError(400, f"model {self.model_name!r} has no chat template: use /v1/completions", "messages")
            messages = [m.template_fields() for m in req.messages]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if isinstance(prompt, list):
            return prompt
        return self.tokenizer(prompt, add_special_tokens=False).input_ids

    def running(self) -> int:
        """Requests decoding now."""
        return self.batcher.running() if self.batcher else self.turns.running()

    def batches(self) -> int:
        """Batches decoding now (one request at a time: 0 or 1)."""
        return self.batcher.batches() if self.batcher else self.turns.running()

    def start(self, req) -> list[tuple[list[int], list[BatchJob | Job]]]:
        """Validate a request and queue its generation (errors here are 400s, before anything is sent).
        Checking a new set of settings runs the target here (in the event loop's thread): this thread's
        OpenMP workers are let go after it, as the setup's are."""
        try:
            return self._start(req)
        finally:
            release_openmp_threads()

    def _start(self, req) -> list[tuple[list[int], list[BatchJob | Job]]]:
        """Each prompt's ids and jobs (its rows: none for an echoed prompt alone), all checked before any is queued."""
        req.refuse_unsupported()
        self.limits.check(req)
        prompts = [self.prompt_ids(req, prompt) for prompt in req.prompts]
        if not all(prompts):
            raise OpenAIError(400, "the prompt is empty", "prompt")
        if getattr(req, "echo", False) and req.top_logprobs_asked is not None and self.leader:
            raise OpenAIError(400, "echo with logprobs is not supported with a sharded target (--tp)", "echo")
        options = dict(self.sampled_options if req.temperature > 0 else self.tree_options)
        options.update({name: getattr(req, name) for name in TREE_FIELDS if getattr(req, name) is not None})
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        top = req.top_logprobs_asked
        sampling = dict(stop=req.stop_list or None, temperature=req.temperature, top_p=req.top_p,
                        top_k=max(req.top_k, 0), min_p=req.min_p)
        if top is not None:  # log-probabilities: its rows keep their logits
            sampling["output_logits"] = True
        started = []
        held_to = req.grammar()
        try:
            with_draft = used_draft(options, self.draft) is not None  # after the request's own tree fields
            for p, ids in enumerate(prompts):
                req.fill_window(len(ids), self.window)
                eos = req.eos(self.eos, self.vocab)
                constraint = None if held_to is None else Constraint(self.tokenizer, held_to, len(ids),
                                                                     eos or self.eos, self.vocab)
                asked = dict(sampling, max_new_tokens=req.new_tokens,
                             logits_processor=req.processors(len(ids), self.vocab, constraint), eos_token_id=eos)
                # choice i (prompt p's j-th: p * n + j) is seeded with seed + i, as a batch of copies is seeded
                seeds = [(seed + p * req.n + j) % 2**63 for j in range(req.rows)]
                started.append((ids, [self._job(ids, with_draft, options, dict(asked, seed=s), top, req)
                                      for s in seeds]))
        except (ValueError, NotImplementedError, TypeError, OpenAIError) as err:
            for _, jobs in started:  # none of them runs
                for job in jobs:
                    job.close()
            raise err if isinstance(err, OpenAIError) else OpenAIError(400, str(err)) from None
        for _, jobs in started:
            for job in jobs if not self.leader else ():  # (a sharded target's jobs take their turns as they run)
                self.batcher.submit(job)
        return started

    def _job(self, ids: list[int], with_draft: bool, options: dict, sampling: dict, top: int | None, req
             ) -> BatchJob | Job:
        """One row's generation: a batch's row, or with a sharded target a generation on every rank in its turn."""
        if self.leader:
            run = self.leader.build(Call(ids, with_draft, dict(**sampling, **options)))
            return Job(run, self.turns, self.expired, lambda: self.discard(run), top)
        sized = self.sizing is not None and req.budget is None  # a budget the request asks is its own
        # a sampled request that named no seed may decode plainly on the steps where the batch is faster so
        row = self._speculator(options, with_draft, sized).row(GenerationRequest(ids, **sampling),
                                                                reproducible=req.seed is not None)
        return BatchJob(row, self.expired, self.batcher, top)

    def _speculator(self, options: dict, with_draft: bool, sized: bool) -> Speculator:
        """The settings checked once per distinct set of them (the greedy, the sampled and the requests' own)."""
        key = repr((sorted(options.items()), with_draft, sized))
        if key not in self.speculators:
            if len(self.speculators) >= 64:  # requests' own tree fields: keep the most recent settings
                self.speculators.pop(next(iter(self.speculators)))
            self.speculators[key] = Speculator(self.target, self.draft if with_draft else None, tokenizer=self.tokenizer,
                                               batch_budget=self.sizing if sized else "rows", **options)
        return self.speculators[key]

    def stopped(self) -> None:
        """The HTTP server has stopped: a sharded target's other ranks stop too."""
        if self.leader:
            self.leader.release()

    def discard(self, run) -> None:
        """A generation that never ran (its request left before its turn) is dropped on every rank."""
        run.end()


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


class Ticket:
    running = False  # its request is decoding (first in line); only its decoding thread then leaves


class Turns:
    """First come, first served: tickets are taken in arrival order and decode one at a time."""

    def __init__(self):
        self._line: deque[Ticket] = deque()
        self._changed = threading.Condition()

    def join(self) -> Ticket:
        ticket = Ticket()
        with self._changed:
            self._line.append(ticket)
        return ticket

    def wait(self, ticket: Ticket, give_up: Callable[[], bool]) -> bool:
        """Block until `ticket` is first in line (True), or until `give_up()` (False: it leaves the line)."""
        with self._changed:
            while ticket in self._line and self._line[0] is not ticket:
                if give_up():
                    self._leave(ticket)
                    return False
                self._changed.wait(timeout=0.05)
            ticket.running = ticket in self._line  # else it left the line (closed) before its turn
            return ticket.running

    def running(self) -> int:
        """How many tickets are decoding now (0 or 1)."""
        with self._changed:
            return int(bool(self._line) and self._line[0].running)

    def leave(self, ticket: Ticket, unless_running: bool = False) -> None:
        with self._changed:
            if not (unless_running and ticket.running):
                self._leave(ticket)

    def _leave(self, ticket: Ticket) -> None:
        if ticket in self._line:
            self._line.remove(ticket)
            self._changed.notify_all()


class Job:
    """One request's generation: decoded in its turn; stops at the next step once cancelled (the client
    left) or once the server's shutdown grace has run out."""

    def __init__(self, run, turns: Turns, expired: threading.Event, discard: Callable[[], None] = lambda: None,
                 logprobs: int | None = None):
        self.run, self.turns, self.expired, self.discard = run, turns, expired, discard
        self.logprobs = logprobs  # the likeliest tokens to report at each new token; None: no log-probabilities
        self.ticket = turns.join()
        self.cancelled = threading.Event()
        self.complete = False  # the generation ran to its end (length, EOS or stop)
        self.joined, self.waited_s = time.perf_counter(), None  # seconds before its turn, once it began

    @property
    def stats(self):
        return self.run.stats

    def stopped(self) -> bool:
        return self.cancelled.is_set() or self.expired.is_set()

    def result(self) -> list[Chunk]:
        """Every chunk: this thread decodes them in its turn."""
        return list(self.chunks())

    def chunks(self) -> Iterator[Chunk]:
        if not self.turns.wait(self.ticket, self.stopped):
            return
        self.waited_s = time.perf_counter() - self.joined
        steps = iter(self.run)
        try:
            for chunk in steps:
                yield chunk_of(chunk, self.run.row, self.logprobs)
                if self.stopped():
                    return
            self.complete = True
        finally:
            steps.close()  # a generation stopped early ends here, in its decoding thread
            self.turns.leave(self.ticket)
            release_openmp_threads()  # this thread decodes no more: its OpenMP workers go (the next one's stay awake)

    def close(self) -> None:
        """Stop: a decoding thread stops at its next step and then leaves the line; a queued request leaves
        now, and its generation, which never ran, is discarded."""
        self.cancelled.set()
        self.turns.leave(self.ticket, unless_running=True)
        if not self.ticket.running:  # left the line before its turn: it never runs now
            self.discard()


SHUT_DOWN = "the server shut down before the request finished"


async def serve(server: Server, request: Request, req, chat: bool):
    """A completion request: refused when shutting down (503) or when the line has no room for its rows (429),
    else in line now, in arrival order, answered whole or as server-sent events."""
    if server.stopping:
        return _error(503, "the server is shutting down", kind="server_error")
    if req.places > max(server.max_queue, 1):  # (a queue of 0 refuses every request with a 429)
        raise OpenAIError(400, f"n={req.n} for {len(req.prompts)} prompt(s) is past this server's limit of "
                          f"{server.max_queue} rows (--max-queue)", "n")
    if server.pending + req.places > server.max_queue:
        return JSONResponse({"error": {"message": f"the queue is full ({server.max_queue} requests)",
                                       "type": "rate_limit_error", "param": None, "code": None}},
                            status_code=429, headers={"Retry-After": "1"})
    prompts = server.start(req)
    completion = Completion(server, request, req, chat, prompts)
    server.pending += len(completion.jobs)
    if not req.stream:
        return await completion.whole()
    return StreamingResponse(completion.events(), media_type="text/event-stream")


class Answer:
    """One choice of a request as it is sent: its text so far, its log-probabilities, how it ended."""

    def __init__(self, completion: "Completion", index: int, job, echoed: int = 0):
        self.index, self.job = index, job
        self.text = TextStream(completion.server.tokenizer, completion.req.stop_list)
        self.logprobs = completion.logprobs(echoed)  # its text's offsets count the echoed prompt's characters

    def push(self, chunk: Chunk, final: bool = False) -> tuple[str, dict | None]:
        """The text `chunk` completes (`final`: the answer ends with it) and the log-probabilities of the tokens
        whose text that sends."""
        text = self.text.push(chunk.ids, final=final)
        if self.logprobs is None:
            return text, None
        self.logprobs.add(chunk.logprobs or [])
        return text, self.logprobs.report(self.text.sent)


class Completion:
    """One admitted request: its prompts' ids and jobs (a row each; `n` sampled choices decode as n rows, greedy
    ones are one row's copies) and the fields of its answer; `done` records how it ended."""

    def __init__(self, server: Server, request: Request, req, chat: bool, prompts: list[tuple[list[int], list]]):
        self.server, self.request, self.req, self.chat, self.prompts = server, request, req, chat, prompts
        self.jobs = [job for _, jobs in prompts for job in jobs]
        self.kind = "chat.completion" if chat else "text_completion"
        self.rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created, self.began = int(time.time()), time.perf_counter()
        # choice i's prompt and the job its tokens come from (None: an echoed prompt alone), prompt after prompt
        self.choices_of = [(p, jobs[j % len(jobs)] if jobs else None) for p, (_, jobs) in enumerate(prompts)
                           for j in range(req.n)]

    def choice(self, index: int, text: str | None, finish: str | None, delta: bool, logprobs: dict | None = None
               ) -> dict:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        body = ({"role": "assistant", "content": text} if text is not None else {}) if delta else \
            {"role": "assistant", "content": text}
        return {"index": index, ("delta" if delta else "message"): body, "logprobs": logprobs, "finish_reason": finish}

    def logprobs(self, echoed: int = 0) -> AnswerLogprobs | None:
        """Where the request asked for log-probabilities, what reports them as its text is sent."""
        if self.req.top_logprobs_asked is None:
            return None
        return AnswerLogprobs(self.server.tokenizer, self.chat, base=echoed)

    async def echoes(self) -> list[tuple[str, dict | None]]:
        """Each prompt as echoed (completions' `echo`): its text as its tokens decode, and where asked its tokens'
        log-probabilities, from one forward over it that the scheduler runs between two steps. ("", None): none."""
        if not getattr(self.req, "echo", False):
            return [("", None)] * len(self.prompts)
        tokenizer, k = self.server.tokenizer, self.req.top_logprobs_asked
        echoes = []
        for ids, _ in self.prompts:
            text, report = tokenizer.decode(ids, skip_special_tokens=True), None
            if k is not None:
                scored = await asyncio.get_running_loop().run_in_executor(self.server.threads,
                                                                          self.server.batcher.score, ids, k)
                report = prompt_report(tokenizer, ids, scored)
            echoes.append((text, report))
        return echoes

    def usage(self) -> dict:
        prompt = sum(len(ids) for ids, _ in self.prompts)
        n = sum(job.stats.new_tokens for _, job in self.choices_of if job)  # every choice's tokens, as OpenAI counts
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}

    def finish_reason(self, job) -> str:
        return "length" if job is None or job.stats.new_tokens >= self.req.new_tokens else "stop"

    def done(self, status: str) -> None:
        server = self.server
        for job in self.jobs:
            job.close()  # a decoding thread stops at its next step; a queued one leaves the line
            server.metrics.observe(job.stats)
            if job.waited_s is not None:
                server.metrics.queue_time.observe(job.waited_s)
                server.metrics.prefill_time.observe(job.stats.prefill_s)
        server.pending -= len(self.jobs)
        server.metrics.latency.observe(time.perf_counter() - self.began)
        server.metrics.requests.labels(self.request.url.path, status).inc()

    async def whole(self):
        """The answer in one response."""
        try:
            echoes = await self.echoes()
            results = await asyncio.get_running_loop().run_in_executor(
                self.server.threads, lambda: {id(job): job.result() for job in self.jobs})
        except BaseException:
            self.done("500")
            raise
        if not all(job.complete for job in self.jobs):
            self.done("503")
            return _error(503, SHUT_DOWN, kind="server_error")
        choices = []
        for index, (p, job) in enumerate(self.choices_of):
            chunks = results[id(job)] if job else []
            whole = Chunk([t for chunk in chunks for t in chunk.ids],
                          [entry for chunk in chunks for entry in chunk.logprobs or []])
            echo, echo_logprobs = echoes[p]
            text, logprobs = Answer(self, index, job, len(echo)).push(whole, final=True)
            choices.append(self.choice(index, echo + text, self.finish_reason(job), delta=False,
                                       logprobs=joined(echo_logprobs, logprobs)))
        body = {"id": self.rid, "object": self.kind, "created": self.created, "model": self.server.model_name,
                "choices": choices, "usage": self.usage()}
        self.done("200")
        return body

    async def events(self):
        """The answer as server-sent events, chunk by chunk as the jobs decode them (each event one choice's)."""
        chat = self.chat
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def produce(job) -> None:
            try:
                for chunk in job.chunks():
                    loop.call_soon_threadsafe(queue.put_nowait, (job, chunk))
            except BaseException as err:  # reported to the client as an error event
                loop.call_soon_threadsafe(queue.put_nowait, (job, err))
            loop.call_soon_threadsafe(queue.put_nowait, (job, None))

        def event(body: dict) -> str:
            return f"data: {json.dumps(body)}\n\n"

        header = {"id": self.rid, "object": self.kind + (".chunk" if chat else ""), "created": self.created,
                  "model": self.server.model_name}
        usage = bool((self.req.stream_options or {}).get("include_usage"))
        if usage:  # OpenAI's rule: every chunk has "usage": null, and one more after the last has it, with no choices
            header["usage"] = None
        status, running = "200", len(self.jobs)
        try:
            echoes = await self.echoes()
            answers = [Answer(self, index, job, len(echoes[p][0])) for index, (p, job) in enumerate(self.choices_of)]
            if chat:
                for answer in answers:  # each choice's first event: its role
                    yield event({**header, "choices": [self.choice(answer.index, "", None, delta=True)]})
            for answer, (p, _) in zip(answers, self.choices_of):  # an echoed prompt first (alone: its only event)
                echo, echo_logprobs = echoes[p]
                if echo:
                    yield event({**header, "choices": [self.choice(answer.index, echo, None if running else "length",
                                                                   delta=True, logprobs=echo_logprobs)]})
            for job in self.jobs:
                loop.run_in_executor(self.server.threads, produce, job)
            while running:
                job, item = await queue.get()
                if isinstance(item, BaseException):
                    status = "500"
                    yield event({"error": {"message": str(item), "type": "server_error"}})
                    break
                if await self.request.is_disconnected():
                    status = "499"
                    break
                if item is None and not job.complete:
                    status = "503"
                    yield event({"error": {"message": SHUT_DOWN, "type": "server_error"}})
                    break
                running -= item is None
                fed = [answer for answer in answers if answer.job is job]  # a greedy job feeds every choice
                for answer in fed:
                    text, logprobs = answer.push(item or Chunk([]), final=item is None)
                    if item is not None and not text:
                        continue
                    finish = None if item is not None else self.finish_reason(job)
                    yield event({**header, "choices": [self.choice(answer.index, text or None if chat else text,
                                                                   finish, delta=True, logprobs=logprobs)]})
            else:
                if usage:
                    yield event({**header, "choices": [], "usage": self.usage()})
                yield "data: [DONE]\n\n"
        except BaseException:  # the client went away (the response is cancelled): 499, as nginx logs it
            status = "499" if status == "200" else status
            raise
        finally:
            self.done(status)


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="opttree", description="OpenAI-compatible speculative decoding")

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, err: OpenAIError):
        server.metrics.requests.labels(request.url.path, str(err.status)).inc()
        return _error(err.status, err.message, err.param, err.kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError):
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        server.metrics.requests.labels(request.url.path, "400").inc()
        return _error(400, f"{param}: {first['msg']}" if param else first["msg"], param)

    @app.get("/health")
    async def health():  # a load balancer's readiness check: 503 once shutdown has begun
        if server.stopping:
            return _error(503, "the server is shutting down", kind="server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "owned_by": "opttree",
                                            "created": 0, "max_model_len": server.window}]}  # vLLM's field

    @app.get("/metrics")
    async def metrics():
        server.metrics.waiting.set(server.pending)
        server.metrics.running.set(server.running())
        server.metrics.lanes.set(server.batches())
        return PlainTextResponse(prom.generate_latest(server.metrics.registry).decode(),
                                 media_type=prom.CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest):
        if req.suffix:
            raise OpenAIError(400, "suffix is not supported by opttree serve", "suffix")
        if req.new_tokens == 0 and not req.echo:
            raise OpenAIError(400, "max_tokens=0 needs echo=true (the prompt scored alone)", "max_tokens")
        if req.best_of not in (None, 1):
            raise OpenAIError(400, "best_of is not supported (n choices are n samples, none ranked)", "best_of")
        return await serve(server, request, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatRequest):
        return await serve(server, request, req, chat=True)

    return app


class GracefulServer(uvicorn.Server):
    """uvicorn's server; on Ctrl-C / SIGTERM the app's requests get `grace` seconds (`Server.begin_shutdown`)
    while uvicorn stops accepting connections and waits for the open ones."""

    def __init__(self, config: uvicorn.Config, app_server: Server, grace: float):
        super().__init__(config)
        self.app_server, self.grace = app_server, grace

    def handle_exit(self, sig, frame) -> None:
        self.app_server.begin_shutdown(self.grace)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, which raises a caught SIGTERM again once the server has stopped: a sharded target's
        other ranks are released before that (`Server.stopped`), and its rank 0 then exits with status 0
        (torchrun takes a rank ended by a signal for a failure)."""
        with super().capture_signals():
            try:
                yield
            finally:
                self.app_server.stopped()
                if self.app_server.leader:
                    self._captured_signals.clear()  # uvicorn's list of the signals it raises again
