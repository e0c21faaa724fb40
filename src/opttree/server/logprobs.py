"""Log-probabilities of an answer's tokens (OpenAI's `logprobs`), as vLLM reports them by default: the
log-softmax of the target's raw logits at each new token, before temperature and the other warpers.

The scheduler turns each chunk's logits into `TokenLogprob`s (`token_logprobs`); an `AnswerLogprobs`
places them in the answer's text and reports those whose text has been sent, in the completions' or
the chat's format. A token is reported once its text begins inside the text sent: with a stop
string, the tokens that lie wholly in it or after it are not reported, as their text is not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

MAX_TOP_LOGPROBS = 20  # vLLM's default `max_logprobs`; OpenAI's chat API allows 20 too
FLOOR = -9999.0  # the log-probability reported for a token of probability 0 (JSON has no -inf), as vLLM does


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None  # None: a prompt's first token, which nothing predicts
    top: tuple[tuple[int, float], ...]  # the `k` likeliest tokens and their log-probabilities, likeliest first


class Chunk(NamedTuple):
    """The tokens one step emitted for a request, with their log-probabilities where it asked for them."""

    ids: list[int]
    logprobs: list[TokenLogprob] | None = None


def chunk_of(ids: torch.Tensor, row, k: int | None) -> Chunk:
    """A row's step's (C,) emitted `ids` as a `Chunk`, with the `k` likeliest tokens at each where `k` is not
    None (the row keeps its logits then: `output_logits`)."""
    return Chunk(ids.tolist(), None if k is None else token_logprobs(row.pop_logits(), ids, k))


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int) -> list[TokenLogprob]:
    """The (C,) `ids` with their log-probabilities under the (C, V) raw `logits` that predicted them, and the
    `k` likeliest tokens at each position (one read to the host)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (C, V)
    chosen = logp.gather(1, ids[:, None].to(logp.device))  # (C, 1)
    top = logp.topk(min(k, logp.shape[-1]), dim=-1)  # (C, k) values and indices
    # (C, 1 + 2k) read at once; the indices are exact in float32 (vocabularies below 2**24)
    table = torch.cat([chosen.clamp_min(FLOOR), top.values.clamp_min(FLOOR), top.indices.to(logp.dtype)], 1).tolist()
    k = top.values.shape[1]
    return [TokenLogprob(token, row[0], tuple(zip(map(int, row[1 + k:]), row[1:1 + k])))
            for token, row in zip(ids.tolist(), table)]


class AnswerLogprobs:
    """An answer's tokens: `add` each chunk's as it comes; `report(sent)` reports those whose text begins before
    character `sent` of the answer (the text sent so far), each once, in order."""

    def __init__(self, tokenizer, chat: bool, base: int = 0):
        self.tokenizer, self.chat, self.base = tokenizer, chat, base  # base: characters before the answer (an echo)
        self.ids: list[int] = []
        self.entries: list[tuple[TokenLogprob, int]] = []  # each token and its text's offset in the answer
        self.taken = 0

    def add(self, entries: list[TokenLogprob]) -> None:
        for entry in entries:
            # where its text begins: the answer's text before it, a character it ends half-way not counted
            before = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
            self.entries.append((entry, len(before)))
            self.ids.append(entry.token)

    def report(self, sent: float) -> dict:
        """The tokens not yet reported whose text begins in the first `sent` characters of the answer, in the chat
        API's format (`{"content": [...]}`) or the completions' (parallel lists)."""
        end = self.taken
        while end < len(self.entries) and self.entries[end][1] < sent:
            end += 1
        entries, self.taken = self.entries[self.taken:end], end
        text = self.text
        if self.chat:
            return {"content": [{**self._token(e.token, e.logprob),
                                 "top_logprobs": [self._token(t, lp) for t, lp in e.top]} for e, _ in entries],
                    "refusal": None}
        return {"tokens": [text(e.token) for e, _ in entries], "token_logprobs": [e.logprob for e, _ in entries],
                # the k likeliest and the chosen token, which may make k + 1 (OpenAI's and vLLM's rule)
                "top_logprobs": [{**{text(t): lp for t, lp in e.top}, text(e.token): e.logprob}
                                 if e.logprob is not None else None for e, _ in entries],
                "text_offset": [self.base + offset for _, offset in entries]}

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _token(self, token: int, logprob: float) -> dict:
        text = self.text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def prompt_report(tokenizer, ids: list[int], scored: list[TokenLogprob]) -> dict:
    """An echoed prompt's tokens in the completions' format: the first one without a log-probability, the others
    with theirs (`scored`, from the target's forward over the prompt)."""
    logprobs = AnswerLogprobs(tokenizer, chat=False)
    logprobs.add([TokenLogprob(ids[0], None, ())] + scored)
    return logprobs.report(float("inf"))  # every token, those of no text too


def joined(first: dict | None, second: dict | None) -> dict | None:
    """Two reports in the completions' format, one after the other."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}
