"""Incremental text for streaming: decoded token chunks that never split a character."""

from __future__ import annotations


class TextStream:
    """Text deltas from token chunks: `push(ids)` returns the text the new tokens complete.

    UTF-8-safe: a character split across chunks (decoded as a trailing U+FFFD) waits for the tokens
    that finish it. With `stop`, the text ends before the first stop string, as OpenAI's API does
    (text that could begin one waits until it is clear). `push([], final=True)` flushes the rest.
    Special tokens are skipped."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer, self.stop, self.ids, self.sent = tokenizer, stop or [], [], 0

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            end = min(hits)
        elif final:
            end = len(text)
        else:
            end = len(text.rstrip("\ufffd"))
            end -= max((k for s in self.stop for k in range(1, len(s)) if text[:end].endswith(s[:k])), default=0)
        delta, self.sent = text[self.sent:end], max(self.sent, end)
        return delta
