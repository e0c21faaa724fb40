"""Bad input gets a clear error naming the problem, and leaves everything usable for the next call."""

import pytest
import torch
from helpers import hf_greedy, tiny_model

import opttree


@pytest.fixture(scope="module")
def pair():
    return tiny_model("llama", seed=1, max_positions=64), tiny_model("llama", seed=2, layers=1, hidden=32)


PROMPT = torch.tensor([[5, 6, 7, 8]])


def still_works(target, draft):
    out = opttree.generate(target, PROMPT, draft, budget=8, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(target, PROMPT, 12))


@pytest.mark.parametrize("kwargs,message", [
    ({"budget": 0}, "budget must be an integer >= 1"),
    ({"budget": -3}, "budget must be an integer >= 1"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"delta": 1.0}, r"delta must be in \[0, 1\)"),
    ({"max_depth": 0}, "max_depth must be an integer >= 1"),
    ({"tree": "bogus"}, "unknown tree policy 'bogus'; available: .*opt"),
    ({"max_new_tokens": 61}, "exceeds the target model's context window of 64"),
])
def test_invalid_arguments(pair, kwargs, message):
    target, draft = pair
    with pytest.raises(ValueError, match=message):
        opttree.generate(target, PROMPT, draft, **{"max_new_tokens": 8, **kwargs})
    still_works(target, draft)


def test_empty_and_malformed_prompts(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="empty prompt"):
        opttree.generate(target, torch.empty(1, 0, dtype=torch.long), draft)
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 96\)"):
        opttree.generate(target, torch.tensor([[3, 500]]), draft)
    with pytest.raises(NotImplementedError, match="batch size 2"):
        opttree.generate(target, torch.ones(2, 3, dtype=torch.long), draft)
    still_works(target, draft)


def test_mismatched_vocabularies(pair):
    target, _ = pair
    other = tiny_model("llama", vocab=100, hidden=32, layers=1)
    with pytest.raises(ValueError, match="vocabularies differ: target has 96 tokens, draft has 100"):
        opttree.generate(target, PROMPT, other, max_new_tokens=8)
    with pytest.raises(ValueError, match="needs a draft model"):
        opttree.generate(target, PROMPT, None, tree="opt", max_new_tokens=8)


def test_attention_that_cannot_take_a_tree_mask(pair):
    target, draft = pair
    odd = tiny_model("llama", seed=3, layers=1, hidden=32)
    odd.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'.*sdpa"):
        opttree.generate(target, PROMPT, odd, max_new_tokens=8)
    with pytest.raises(ValueError, match="target model uses attn_implementation"):
        opttree.generate(odd, PROMPT, draft, max_new_tokens=8)
    still_works(target, draft)


def test_caches_that_cannot_be_rolled_back(pair):
    target, draft = pair
    windowed = tiny_model("mistral", seed=4, sliding_window=16)
    with pytest.raises(NotImplementedError, match="sliding-window attention \\(window 16\\)"):
        opttree.generate(windowed, PROMPT, draft, max_new_tokens=20)
    # within the window, sliding attention is plain causal attention: allowed and exact
    out = opttree.generate(windowed, PROMPT, draft, budget=4, max_new_tokens=10, eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(windowed, PROMPT, 10))
    linear = tiny_model("llama", seed=5)
    linear.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(NotImplementedError, match="linear_attention"):
        opttree.generate(linear, PROMPT, draft, max_new_tokens=8)
    still_works(target, draft)


def test_stop_strings_need_a_tokenizer(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="stop strings need the tokenizer"):
        opttree.generate(target, PROMPT, draft, stop=["\n"], max_new_tokens=8)


def test_models_without_weights_are_refused(pair):
    target, draft = pair
    elsewhere = tiny_model("llama", seed=6, layers=1, hidden=32).to("meta")
    with pytest.raises(ValueError, match="draft model is on the meta device"):
        opttree.generate(target, PROMPT, elsewhere, max_new_tokens=8)
    still_works(target, draft)
