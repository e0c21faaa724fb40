"""Stop strings end generation at the same token as `target.generate(stop_strings=..., tokenizer=...)`:
transformers matches the tail of the whole sequence (prompt included), byte by byte for byte-level
tokenizers, so a string begun in the prompt counts and U+FFFD never matches half a character."""

import pytest
import torch
from helpers import hf_greedy

import opttree


@pytest.fixture(scope="module")
def shipped():
    return opttree.demo_models(dtype=torch.float32)


def prompt_ending_inside(tokenizer, text: str, cut: int) -> torch.Tensor:
    """(1, T) the tokens of `text` less the last `cut`: with byte tokens, a prompt ending mid-character."""
    ids = tokenizer(text).input_ids
    return torch.tensor([ids[: len(ids) - cut]])


def assert_stops_like_transformers(shipped, prompt: torch.Tensor, stop: list[str], max_new_tokens: int = 16):
    target, draft, tokenizer = shipped
    ref = hf_greedy(target, prompt, max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                    stop_strings=stop, tokenizer=tokenizer)
    for kw in (dict(budget=8), dict(tree="ar")):
        out = opttree.generate(target, prompt, draft, stop=stop, tokenizer=tokenizer,
                               max_new_tokens=max_new_tokens, **kw)
        assert out.sequences.tolist() == ref.tolist(), (stop, kw)
    return ref.shape[1] - prompt.shape[1]  # how many tokens transformers generated


def test_a_stop_string_begun_in_the_prompt(shipped):
    tokenizer = shipped[2]
    prompt = tokenizer("def add(a, b):\n", return_tensors="pt").input_ids  # greedy goes on with "\ndef _get_x(..."
    assert assert_stops_like_transformers(shipped, prompt, ["):\n\n"]) == 1
    assert assert_stops_like_transformers(shipped, prompt, ["b):\n\ndef"]) == 2
    assert assert_stops_like_transformers(shipped, prompt, ["add("]) == 16  # only in the prompt: never stops


def test_a_character_begun_in_the_prompt(shipped):
    """The prompt ends with two of the three bytes of a character that the first new token completes."""
    tokenizer = shipped[2]
    prompt = prompt_ending_inside(tokenizer, "# — — — —\u2014", 1)  # greedy completes "\u201c"
    assert assert_stops_like_transformers(shipped, prompt, ["\u201c"]) == 1
    assert assert_stops_like_transformers(shipped, prompt, ["\u201cutf"]) == 2


@pytest.mark.parametrize("text,cut", [("# — — — —\u2014", 1), ("x = '→'\ny = '→'\nz = '→", 2)])
def test_a_replacement_character_never_matches_half_a_character(shipped, text, cut):
    """Decoded alone, the first new tokens are half a character (U+FFFD); transformers matches bytes."""
    tokenizer, prompt = shipped[2], prompt_ending_inside(shipped[2], text, cut)
    first = tokenizer.decode(hf_greedy(shipped[0], prompt, 1)[0, -1:])
    assert "\ufffd" in first  # what a decode-based matcher would see
    assert assert_stops_like_transformers(shipped, prompt, ["\ufffd"]) == 16
    assert assert_stops_like_transformers(shipped, prompt, [first]) == 16


def test_stop_strings_ending_anywhere_in_a_chunk(shipped):
    """Strings spanning 3 tokens, ending at each of several new tokens (inside accepted chunks)."""
    target, _, tokenizer = shipped
    prompt = tokenizer("class Stack:\n    def push(self, x):\n", return_tensors="pt").input_ids
    full = hf_greedy(target, prompt, 16, eos_token_id=tokenizer.eos_token_id)[0].tolist()
    for k in (1, 3, 6, 10):
        end = prompt.shape[1] + k
        stop = tokenizer.decode(full[end - 3 : end])
        assert assert_stops_like_transformers(shipped, prompt, [stop, "never in this text"]) <= k
