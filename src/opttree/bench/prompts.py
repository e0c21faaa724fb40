"""Benchmark prompts: Spec-Bench questions, HumanEval problems, or plain text lines.

Formats, chosen by the file's extension:
- `.jsonl` / `.json`: one JSON object per line, either Spec-Bench (`turns`: list of user turns,
  `category`, `question_id`) or HumanEval (`prompt`, `task_id`, optional `category`).
- anything else: plain text, one prompt per non-empty line; or, when the file has lines holding only
  `---`, one prompt per block between them (multi-line prompts: each line keeps its newline; blank
  lines next to a separator are dropped).

A Spec-Bench question is a user turn (`chat=True`): it goes through the tokenizer's chat template
when the tokenizer has one. Only the first turn is used (no second turn that depends on an answer).
HumanEval prompts and text lines are continued as they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch

JSON_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    chat: bool = False  # a user turn (Spec-Bench) rather than text to continue


def load_prompts(
    path: str | Path,
    categories: Sequence[str] | None = None,
    limit: int | None = None,
    per_category: int | None = None,
) -> list[Prompt]:
    """Read a prompt file, keep the wanted categories, at most `per_category` of each, then `limit` in all."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix.lower() in JSON_SUFFIXES:
        prompts = parse_jsonl(lines, default_category=path.stem, source=str(path))
    else:
        prompts = parse_text(lines, category=path.stem)
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return select(prompts, categories, limit, per_category)


def parse_jsonl(lines: Iterable[str], default_category: str, source: str = "<lines>") -> list[Prompt]:
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not a JSON object ({err.msg})") from None
        prompts.append(parse_record(record, default_category, where))
    return prompts


def parse_record(record, default_category: str, where: str) -> Prompt:
    """One JSON line: Spec-Bench (`turns`) or HumanEval (`prompt`)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with 'turns' or 'prompt', got {type(record).__name__}")
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
        ident = record.get("question_id", where)
        return Prompt(str(ident), str(record.get("category", default_category)), turns[0], chat=True)
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise ValueError(f"{where}: 'prompt' must be a string")
        ident = record.get("task_id", where)
        return Prompt(str(ident), str(record.get("category", default_category)), record["prompt"])
    raise ValueError(f"{where}: a JSON prompt needs 'turns' (Spec-Bench) or 'prompt' (HumanEval); keys: {sorted(record)}")


SEPARATOR = "---"


def parse_text(lines: Iterable[str], category: str) -> list[Prompt]:
    """One prompt per non-empty line, or per `---`-separated block when the file has such lines."""
    lines = list(lines)
    if not any(line.strip() == SEPARATOR for line in lines):
        return [Prompt(f"{category}:{n}", category, line) for n, line in enumerate(lines, start=1) if line.strip()]
    blocks, current = [], []
    for line in lines + [SEPARATOR]:
        if line.strip() == SEPARATOR:
            blocks.append("\n".join(current))
            current = []
        else:
            current.append(line)
    texts = [block.strip("\n") for block in blocks if block.strip()]  # blank lines around a separator dropped
    return [Prompt(f"{category}:{n}", category, text + "\n") for n, text in enumerate(texts, start=1)]


def select(
    prompts: list[Prompt],
    categories: Sequence[str] | None = None,
    limit: int | None = None,
    per_category: int | None = None,
) -> list[Prompt]:
    """Filter by category (in file order), cap each category, then cap the total."""
    for name, value in (("limit", limit), ("per_category", per_category)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if categories:
        present = sorted({p.category for p in prompts})
        unknown = sorted(set(categories) - set(present))
        if unknown:
            raise ValueError(f"unknown categories {unknown}; the prompt file has: {', '.join(present)}")
        prompts = [p for p in prompts if p.category in set(categories)]
    if per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= per_category:
                kept.append(p)
        prompts = kept
    return prompts[:limit] if limit is not None else prompts


def encode(tokenizer, prompt: Prompt) -> torch.Tensor:
    """Token ids (1, T) of a prompt: chat template for user turns when the tokenizer has one."""
    text = prompt.text
    special = True
    if prompt.chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        special = False  # the template already holds the special tokens
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=special).input_ids  # (1, T)
    if ids.shape[1] == 0:
        raise ValueError(f"prompt {prompt.id!r} encodes to no tokens")
    return ids
