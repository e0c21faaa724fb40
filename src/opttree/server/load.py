"""A bounded load test of a running `opttree serve` (or any OpenAI-compatible completions server).

`clients` threads each send `requests` requests, a mix of plain and streamed completions at
temperature 0 (some of two choices with their log-probabilities, which must agree with each other and with
their text; some held to a choice of words, vLLM's `guided_choice`, which must answer one of them), streams the
client abandons after the first event (cancellations) and malformed requests. Every well-formed answer is
checked: against `expected(prompt, max_tokens)` when given (e.g. `opttree.generate`'s text), otherwise for
consistency (the same prompt and length must give the same text in every request and either mode: an answer
mixed up with another request's shows). The
server's `/metrics` request counters must grow by exactly what was sent. Reports p50 / p99 latency
and tokens per second.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable

import httpx
import numpy as np

PROMPTS = (
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\ndef list_files(path):\n",
    "def is_prime(n):\n",
    "def merge_sort(items):\n",
    "def read_json(path):\n",
    "def count_words(text):\n",
    "def binary_search(items, target):\n",
)
# request r of client c is CYCLE[(c + r) % 6]; "choices": a plain completion of n=2 with logprobs=1; "structured":
# one held to one of WORDS (a structured output: `guided_choice`)
CYCLE = ("plain", "stream", "choices", "cancel", "malformed", "structured")
ANSWERED = ("plain", "stream", "choices", "structured")  # the kinds answered whole
WORDS = ("True", "False", "None")
MALFORMED = (  # (body as sent, what is wrong)
    ("{not json", "malformed JSON"),
    ('{"prompt": "x", "max_tokens": -1}', "negative max_tokens"),
    ('{"prompt": "x", "n": 0}', "n < 1"),
    ('{"prompt": "x", "temperature": "hot"}', "a string temperature"),
    ('{"max_tokens": 4}', "no prompt"),
)
REQUESTS_METRIC = re.compile(r'^opttree:requests_total\{endpoint="/v1/completions",status="(\d+)"\} (\S+)$', re.M)


@dataclass
class Outcome:
    kind: str
    prompt: str = ""
    max_tokens: int = 0
    text: str | None = None
    tokens: int = 0
    latency_s: float = 0.0
    retries: int = 0  # 429s answered with a retry
    problem: str = ""  # empty: as expected


def metric_totals(url: str) -> dict[str, float]:
    """The server's Prometheus totals now: histogram sums and counts (`name_sum` / `name_count`) and counters
    (`name_total`)."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    pairs = (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))
    return {name: float(value) for name, value in pairs if name.endswith(("_sum", "_count", "_total"))}


def server_account(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """What `opttree serve` did between two `metric_totals`: the batch's steps, their seconds, rows a step, the
    mean prefill a request joined with (shared by requests that joined together), and the draft tokens accepted a
    request a step (the speculative gain: each step also emits one token of the target's own); None from another
    server."""
    names = ("opttree:iteration_seconds", "opttree:batch_size", "opttree:request_prefill_time_seconds")
    if any(f"{name}_count" not in after for name in names):
        return None
    grew = {key: after[key] - before.get(key, 0.0) for key in after}
    steps, prefills = grew["opttree:iteration_seconds_count"], grew["opttree:request_prefill_time_seconds_count"]
    row_steps = grew.get("opttree:spec_decode_num_drafts_total", 0.0)  # a request's steps, summed over requests
    return {"steps": int(steps), "step_s": grew["opttree:iteration_seconds_sum"],
            "rows_per_step": grew["opttree:batch_size_sum"] / steps if steps else 0.0,
            "prefill_s_per_request": grew["opttree:request_prefill_time_seconds_sum"] / prefills if prefills else 0.0,
            "accepted_per_request_step": grew.get("opttree:spec_decode_num_accepted_tokens_total", 0.0) / row_steps
            if row_steps else 0.0}


@dataclass
class LoadReport:
    clients: int
    outcomes: list[Outcome]
    wall_s: float
    problems: list[str] = field(default_factory=list)
    server: dict | None = None  # `server_account` over the load (None: not an opttree server)

    @property
    def ok(self) -> bool:
        return not self.problems

    def latencies(self) -> np.ndarray:
        return np.array([o.latency_s for o in self.outcomes if o.kind in ANSWERED and not o.problem])

    def summary(self) -> dict:
        kinds = Counter(o.kind for o in self.outcomes)
        lat = self.latencies()
        tokens = sum(o.tokens for o in self.outcomes if o.kind in ANSWERED)  # a choices answer's tokens counted once
        return {
            "clients": self.clients,
            "requests": len(self.outcomes),
            "by_kind": dict(sorted(kinds.items())),
            "retries_after_429": sum(o.retries for o in self.outcomes),
            "latency_p50_s": float(np.percentile(lat, 50)) if lat.size else None,
            "latency_p99_s": float(np.percentile(lat, 99)) if lat.size else None,
            "completion_tokens": tokens,
            "tokens_per_s": tokens / self.wall_s if self.wall_s else 0.0,
            "wall_s": self.wall_s,
            "server": self.server,
            "problems": self.problems,
        }

    def table(self) -> str:
        s = self.summary()
        lines = [f"{s['requests']} requests from {s['clients']} clients in {s['wall_s']:.1f} s: "
                 + ", ".join(f"{n} {k}" for k, n in s["by_kind"].items())]
        if s["latency_p50_s"] is not None:
            lines.append(f"latency of complete answers: p50 {s['latency_p50_s']:.2f} s, p99 {s['latency_p99_s']:.2f} s")
        lines.append(f"{s['completion_tokens']} completion tokens, {s['tokens_per_s']:.1f} tokens/s overall; "
                     f"{s['retries_after_429']} retries after 429")
        server = self.server
        if server is not None and server["steps"]:
            lines.append(f"the server: {server['steps']} steps of {server['rows_per_step']:.1f} requests on average, "
                         f"{server['step_s']:.1f} s in them ({server['step_s'] / self.wall_s:.0%} of the wall), "
                         f"prefills of {1000 * server['prefill_s_per_request']:.0f} ms a request, "
                         f"{server['accepted_per_request_step']:.2f} draft tokens accepted a request a step")
        lines.append("all answers complete and correct, /metrics counts match" if self.ok else
                     f"{len(self.problems)} problems:\n  " + "\n  ".join(self.problems[:20]))
        return "\n".join(lines)


def run_load(url: str, clients: int = 8, requests: int = 20, max_tokens: int = 8, cancel_tokens: int = 64,
             expected: Callable[[str, int], str] | None = None, timeout_s: float = 600.0) -> LoadReport:
    """Load `url` (the server's root, e.g. http://127.0.0.1:8000) and check every answer (see module doc)."""
    before, totals = _request_counts(url), metric_totals(url)
    outcomes: list[list[Outcome]] = [[] for _ in range(clients)]

    def client(c: int) -> None:
        with httpx.Client(base_url=url, timeout=timeout_s) as http:
            for r in range(requests):
                kind = CYCLE[(c + r) % len(CYCLE)]
                prompt, n = PROMPTS[c % len(PROMPTS)], max_tokens + r % 3
                outcomes[c].append(_send(http, kind, prompt, n, cancel_tokens, r))

    began = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report = LoadReport(clients, [o for per_client in outcomes for o in per_client], time.perf_counter() - began)
    report.problems += [f"{o.kind} {o.prompt[:24]!r} max_tokens={o.max_tokens}: {o.problem}"
                        for o in report.outcomes if o.problem]
    report.problems += _check_texts(report.outcomes, expected)
    report.problems += _check_metrics(report.outcomes, before, _request_counts(url, settle=True))
    report.server = server_account(totals, metric_totals(url))
    return report


def _send(http: httpx.Client, kind: str, prompt: str, max_tokens: int, cancel_tokens: int, r: int) -> Outcome:
    out = Outcome(kind, prompt, max_tokens)
    began = time.perf_counter()
    while True:  # 429: wait as told and send again
        if kind == "malformed":
            body, what = MALFORMED[r % len(MALFORMED)]
            response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            if _told_to_wait(response, out):
                continue
            error = response.json().get("error", {}) if response.headers.get("content-type", "").startswith(
                "application/json") else {}
            if response.status_code != 400 or not error.get("message"):
                out.problem = f"{what}: expected a 400 with an OpenAI error, got {response.status_code} {response.text[:80]}"
            return out
        body = {"prompt": prompt, "temperature": 0, "max_tokens": cancel_tokens if kind == "cancel" else max_tokens}
        if kind in ("plain", "choices", "structured"):
            if kind == "choices":
                body.update(n=2, logprobs=1)
            if kind == "structured":
                body.update(guided_choice=list(WORDS))
            response = http.post("/v1/completions", json=body)
            if _told_to_wait(response, out):
                continue
            if response.status_code != 200:
                out.problem = f"status {response.status_code}: {response.text[:120]}"
                return out
            answer = response.json()
            out.text, out.tokens = answer["choices"][0]["text"], answer["usage"]["completion_tokens"]
            if answer["choices"][0]["finish_reason"] not in ("stop", "length"):
                out.problem = f"finish_reason {answer['choices'][0]['finish_reason']!r}"
            if kind == "choices":
                out.tokens //= 2
                out.problem = out.problem or _choices_problem(answer["choices"])
            if kind == "structured" and (out.text not in WORDS or answer["choices"][0]["finish_reason"] != "stop"):
                out.problem = out.problem or f"held to one of {WORDS}, answered {out.text!r}"
        else:
            body.update(stream=True, stream_options={"include_usage": True})
            with http.stream("POST", "/v1/completions", json=body) as response:
                if _told_to_wait(response, out):
                    continue
                if response.status_code != 200:
                    out.problem = f"status {response.status_code}"
                    return out
                events = _events(response)
                if kind == "cancel":  # the first event, then the client goes away mid-stream
                    if next(events, None) is None:
                        out.problem = "no event before the stream ended"
                    return out
                _read_stream(events, out)
        out.latency_s = time.perf_counter() - began
        return out


def _choices_problem(choices: list[dict]) -> str:
    """What is wrong with a greedy answer's two choices and their log-probabilities ("": nothing)."""
    if sorted(c["index"] for c in choices) != [0, 1] or choices[0]["text"] != choices[1]["text"]:
        return f"two greedy choices differ or are misnumbered: {[(c['index'], c['text']) for c in choices]}"
    for choice in choices:
        logprobs = choice["logprobs"] or {}
        if "".join(logprobs.get("tokens", [])) != choice["text"]:
            return f"the tokens with log-probabilities are not the text: {logprobs.get('tokens')!r}"
        tops = logprobs["top_logprobs"]
        if any(lp is None or lp > 0 or max(top.values()) != lp for lp, top in zip(logprobs["token_logprobs"], tops)):
            return "a greedy token that is not the likeliest, or a log-probability above 0"
    return ""


def _told_to_wait(response: httpx.Response, out: Outcome) -> bool:
    """A 429: wait as its Retry-After says, count the retry; the caller sends again."""
    if response.status_code != 429:
        return False
    out.retries += 1
    time.sleep(float(response.headers.get("retry-after", 1)))
    return True


def _events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


def _read_stream(events, out: Outcome) -> None:
    pieces, finish, done = [], None, False
    for data in events:
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            out.problem = f"error event: {event['error'].get('message')}"
            return
        if event.get("usage"):  # the chunk after the last choice's (OpenAI's `include_usage`)
            out.tokens = event["usage"]["completion_tokens"]
        for choice in event["choices"]:
            pieces.append(choice["text"])
            finish = choice["finish_reason"] or finish
    out.text = "".join(pieces)
    if not done or finish not in ("stop", "length"):
        out.problem = f"stream ended without [DONE] or finish_reason (got {finish!r})"


def _check_texts(outcomes: list[Outcome], expected: Callable[[str, int], str] | None) -> list[str]:
    answers: dict[tuple[str, int, bool], set[str]] = defaultdict(set)
    problems = []
    for o in outcomes:
        if o.kind in ANSWERED and not o.problem:
            held = o.kind == "structured"  # its own answer (the same in every such request), not the plain one
            answers[(o.prompt, o.max_tokens, held)].add(o.text)
            if expected is not None and not held and o.text != (want := expected(o.prompt, o.max_tokens)):
                problems.append(f"{o.kind} {o.prompt[:24]!r} max_tokens={o.max_tokens}: got {o.text!r}, "
                                f"expected {want!r}")
    problems += [f"{prompt[:24]!r} max_tokens={n}: {len(texts)} different answers at temperature 0"
                 for (prompt, n, _), texts in answers.items() if len(texts) > 1]
    return problems


def _request_counts(url: str, settle: bool = False) -> Counter:
    """The server's finished /v1/completions requests by status; with `settle`, once cancelled requests
    have been counted too (the server notices a gone client at its next step)."""
    for _ in range(100 if settle else 1):
        text = httpx.get(url + "/metrics").text
        counts = Counter({status: float(value) for status, value in REQUESTS_METRIC.findall(text)})
        waiting = re.search(r"^opttree:num_requests_waiting (\S+)$", text, re.M)
        if not settle or waiting is None or float(waiting.group(1)) == 0:
            return counts
        time.sleep(0.1)
    return counts


def _check_metrics(outcomes: list[Outcome], before: Counter, after: Counter) -> list[str]:
    kinds = Counter(o.kind for o in outcomes)
    grew = {status: after.get(status, 0) - before.get(status, 0) for status in set(after) | set(before)}
    want = {"200": sum(kinds[kind] for kind in ANSWERED), "400": kinds["malformed"], "499": kinds["cancel"]}
    return [f"/metrics counted {grew.get(status, 0):g} requests with status {status}, the load test sent {n}"
            for status, n in want.items() if grew.get(status, 0) != n] + \
           [f"/metrics counted {n:g} unexpected requests with status {status}"
            for status, n in grew.items() if status not in want and n]


def cmd_load_test(args) -> int:
    report = run_load(args.url.rstrip("/"), args.clients, args.requests, args.max_tokens, args.cancel_tokens)
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.summary(), f, indent=2)
    return 0 if report.ok else 1
