"""Structured outputs: the new tokens held to a grammar (a JSON schema, any JSON object, a regular expression, one of
a list of strings, or a Lark grammar), exactly, with any tree.

A grammar is a logits processor (`Constraint`): at each position the tokens the grammar cannot take next get a
score of -inf, as `target.generate(logits_processor=[constraint])` applies it. It is a pure function of the context
(the tokens after the prompt decide the mask), so opttree applies it to every node of a tree with that node's own
context, like the other per-node processors: greedy answers are `target.generate`'s with the same processor, sampled
ones follow its distribution. A draft token the grammar refuses is never accepted (the target's score for it is
-inf). The matching is llguidance's (the grammar engine of vLLM, SGLang and llama.cpp).

    constraint = opttree.grammar.Constraint(tokenizer, opttree.grammar.json_schema(schema), prompt_len=len(ids))
    out = opttree.generate(target, draft, ids, logits_processor=[constraint])
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence

import numpy as np
import torch
from transformers.generation.logits_process import LogitsProcessor


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:  # pragma: no cover - a dependency of the package
        raise ImportError("structured outputs need llguidance: pip install llguidance") from None
    return llguidance


def json_schema(schema: dict | str, any_whitespace: bool = False) -> str:
    """The grammar of the JSON documents `schema` (a JSON schema, a dict or its text) accepts, laid out as
    `json.dumps` writes them (", " and ": ", nothing else between tokens; `any_whitespace`: any JSON whitespace, which
    small models tend to fill with blank lines)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"the JSON schema is not JSON: {error}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is a JSON object, not {type(schema).__name__}")
    layout = {} if any_whitespace else {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=layout)


def json_object(any_whitespace: bool = False) -> str:
    """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
    return json_schema({"type": "object"}, any_whitespace)


def regex(pattern: str) -> str:
    """The texts the regular expression matches in full."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("a regular expression is a non-empty text")
    return _llguidance().LLMatcher.grammar_from_regex(pattern)


def choice(options: Sequence[str]) -> str:
    """Exactly one of `options`."""
    if not options or not all(isinstance(option, str) and option for option in options):
        raise ValueError("a choice needs a list of non-empty strings")
    return regex("|".join(f"({re.escape(option)})" for option in options))


def lark(grammar: str) -> str:
    """A Lark grammar (llguidance's dialect: `start: ...`; JSON schemas inline with `%json {...}`), or llama.cpp's
    GBNF (`root ::= ...`, as vLLM's `guided_grammar` takes it), converted."""
    from llguidance.gbnf_to_lark import any_to_lark

    if not isinstance(grammar, str) or not grammar.strip():
        raise ValueError("a grammar is a non-empty text")
    try:
        text = any_to_lark(grammar)
    except Exception as error:  # the converter's own parse errors
        raise ValueError(f"the grammar is not valid GBNF: {error}") from None
    return _llguidance().LLMatcher.grammar_from_lark(text)


# what a caller may ask for, by name -> the grammar's text
KINDS = {"json_schema": json_schema, "json_object": lambda on: json_object() if on else None, "regex": regex,
         "choice": choice, "lark": lark}


def one_of(**asked) -> str | None:
    """The grammar of the one kind asked (KINDS' names; None or False: not asked); None where none is."""
    given = {kind: value for kind, value in asked.items() if value is not None and value is not False}
    if len(given) > 1:
        raise ValueError(f"one grammar at a time: {', '.join(given)} were given")
    if not given:
        return None
    ((kind, value),) = given.items()
    return KINDS[kind](value)


@functools.lru_cache(maxsize=8)
def _tokenizer(tokenizer, vocab_size: int, eos: tuple[int, ...]):
    """llguidance's view of a Hugging Face fast tokenizer (built once per tokenizer, vocabulary and EOS ids: ~0.1 s)."""
    llguidance = _llguidance()
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos))
    except ValueError as error:
        raise ValueError(f"structured outputs need a fast (tokenizers-backed) tokenizer: {error}") from None


class Constraint(LogitsProcessor):
    """Scores of the tokens `grammar` cannot take next set to -inf, given the tokens after the first `prompt_len`
    of each row's context. `eos_token_id`: the ids that end a sequence (default: the tokenizer's), allowed where the
    grammar is complete and the only tokens allowed once it can take no more. `vocab_size`: the model's logits'
    width (default: the tokenizer's length).

    One llguidance matcher follows the contexts it is asked about: it rolls back to the longest prefix it shares with
    the next one and consumes the rest, so the rows of a tree (siblings, then their children) cost a few tokens each.
    A row whose own tokens the grammar refuses (a draft path past a token it cannot take: never accepted) keeps its
    scores."""

    def __init__(self, tokenizer, grammar: str, prompt_len: int, eos_token_id: int | Sequence[int] | None = None,
                 vocab_size: int | None = None):
        llguidance = _llguidance()
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        eos = tuple([eos] if isinstance(eos, int) else eos or ())
        if not eos:
            raise ValueError("a grammar needs an end-of-sequence token to end the answer with once it is complete")
        self.hf_tokenizer, self.eos, self.vocab_size = tokenizer, eos, int(vocab_size or len(tokenizer))
        self.prompt_len = int(prompt_len)
        self.grammar = grammar
        self.tokenizer = _tokenizer(tokenizer, self.vocab_size, eos)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem and not problem.startswith("WARNING"):
            raise ValueError(f"the grammar is not valid: {problem}")
        self.matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        self.consumed: list[int] = []  # the tokens the matcher has taken, in order

    def __reduce__(self):
        """Pickled as its settings (llguidance's objects are not picklable): a rank of a sharded server builds its
        own matcher."""
        return Constraint, (self.hf_tokenizer, self.grammar, self.prompt_len, self.eos, self.vocab_size)

    def _follow(self, tokens: list[int]) -> bool:
        """Bring the matcher to just after `tokens`; False where the grammar refuses one of them."""
        shared = len(self.consumed) if tokens[: len(self.consumed)] == self.consumed else 0
        if not shared:  # find where they part
            for a, b in zip(self.consumed, tokens):
                if a != b:
                    break
                shared += 1
        if shared < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - shared)
            del self.consumed[shared:]
        rest = tokens[shared:]
        taken = self.matcher.try_consume_tokens(rest) if rest else 0
        self.consumed += rest[:taken]
        return taken == len(rest) and not self.matcher.is_error()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """input_ids: (R, T) contexts; scores: (R, V). Returns (R, V) with the refused tokens at -inf."""
        allowed = self.allowed(input_ids[:, self.prompt_len:].tolist(), scores.shape[-1])  # the answers alone
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))

    def allowed(self, answers: list[list[int]], width: int) -> torch.Tensor:
        """(R, width) bool: the tokens the grammar takes after each answer so far (the tokens after the prompt); all
        of them after an answer it refuses; none past the tokenizer's vocabulary."""
        rows = len(answers)
        words = torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)  # (R, W) all allowed
        for r, tokens in enumerate(answers):
            if self._follow(tokens):  # the row's bits, written by llguidance
                self.matcher.unsafe_compute_mask_ptr(words[r].data_ptr(), words.shape[1] * 4)
        bits = np.unpackbits(words.numpy().view(np.uint8), axis=1, bitorder="little")  # (R, 32 W): token order
        allowed = torch.from_numpy(bits[:, :width]).bool()  # (R, <= width)
        if allowed.shape[-1] < width:  # logits wider than the tokenizer: those tokens are never text
            allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[-1]))
        return allowed

    def complete(self, new_tokens: Sequence[int]) -> bool:
        """Whether `new_tokens` (an answer, its EOS included or not) is a whole sentence of the grammar."""
        tokens = list(new_tokens)
        if tokens and tokens[-1] in self.eos:
            tokens.pop()
        return self._follow(tokens) and self.matcher.is_accepting()
