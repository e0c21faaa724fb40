"""Arguments as users pass them: numpy and tensor scalars, BatchEncodings, and transformers' own
spellings of generation settings (`do_sample`, `max_length`, `attention_mask`), turned into
SpecConfig's plain fields, or refused with a message naming the argument."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping

import torch

from .config import SpecConfig

INT_FIELDS = ("budget", "max_depth", "max_new_tokens", "top_k", "seed", "draft_window")
FLOAT_FIELDS = ("delta", "max_time", "temperature", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                "top_h", "draft_temperature")


def scalar(value, name: str, kind: type):
    """A Python int / float from numpy or 0-d tensor scalars; other values pass through to validation."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if kind is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if kind is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


def prompt_and_mask(input_ids):
    """(input ids, attention mask or None) from ids, a BatchEncoding or a dict with 'input_ids'."""
    if isinstance(input_ids, Mapping):
        if "input_ids" not in input_ids:
            raise ValueError(f"the prompt mapping has no 'input_ids' (keys: {sorted(input_ids)})")
        return input_ids["input_ids"], input_ids.get("attention_mask")
    return input_ids, None


def spec_options(options: dict, prompt_len: int, attention_mask=None) -> dict:
    """SpecConfig keyword arguments from what the caller passed (transformers' spellings included)."""
    options = dict(options)
    mask = options.pop("attention_mask", attention_mask)
    if mask is not None and not bool(torch.as_tensor(mask).eq(1).all()):
        raise NotImplementedError("attention_mask with zeros (padding): opttree decodes one unpadded sequence; "
                                  "pass the prompt's tokens without padding")
    if options.pop("num_beams", 1) != 1:
        raise NotImplementedError("num_beams > 1: opttree does not do beam search")
    if "do_sample" in options:
        do_sample = options.pop("do_sample")
        if not do_sample:
            if options.get("temperature", 0) != 0:
                raise ValueError("do_sample=False with temperature > 0: pick one (temperature=0 is greedy)")
            options["temperature"] = 0.0
        else:
            options.setdefault("temperature", 1.0)
            if options["temperature"] == 0:
                raise ValueError("do_sample=True with temperature=0: sampling needs a temperature > 0")
    if "max_length" in options:
        max_length = scalar(options.pop("max_length"), "max_length", int)
        if "max_new_tokens" in options:
            raise ValueError("pass max_new_tokens or max_length, not both")
        if not isinstance(max_length, int) or max_length <= prompt_len:
            raise ValueError(f"max_length={max_length!r} leaves no room after the {prompt_len}-token prompt")
        options["max_new_tokens"] = max_length - prompt_len
    known = {f.name for f in dataclasses.fields(SpecConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown argument(s) {unknown}; opttree takes {sorted(known)}, do_sample, max_length, "
                        "attention_mask, tokenizer, eos_token_id, stop, logits_processor and generation_config")
    for name in INT_FIELDS:
        if name in options:
            options[name] = scalar(options[name], name, int)
    for name in FLOAT_FIELDS:
        if name in options:
            options[name] = scalar(options[name], name, float)
    return options


def eos_list(eos_token_id) -> list[int]:
    """An id, a list / tuple / tensor / numpy array of ids, or None -> a list of ints."""
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor) or hasattr(eos_token_id, "tolist"):
        eos_token_id = eos_token_id.tolist()
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    out = [scalar(i, "eos_token_id", int) for i in ids]
    if not all(isinstance(i, int) for i in out):
        raise ValueError(f"eos_token_id must be an int or a list of ints, got {eos_token_id!r}")
    return out
