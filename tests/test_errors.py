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
    ({"temperature": -0.5}, "temperature must be 0 \\(greedy\\) or a finite number"),
    ({"temperature": 1e-300}, "temperature must be 0 \\(greedy\\) or a finite number >= 0.0001"),
    ({"seed": 2**64}, r"seed must be an integer in \[0, 2\*\*64\)"),
    ({"stop": ""}, "stop strings must be non-empty"),
    ({"num_return_sequences": 2}, "num_return_sequences=2 with greedy decoding"),
    ({"output_attentions": True}, r"unknown argument\(s\) \[.output_attentions.\]"),
    ({"attention_mask": torch.tensor([[0, 1, 1, 1]])}, "attention_mask with zeros"),
    ({"do_sample": False, "temperature": 0.7}, "do_sample=False with temperature > 0"),
    ({"temperature": float("nan")}, "temperature must be 0 \\(greedy\\)"),
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
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=message):
        opttree.generate(target, PROMPT, draft, **{"max_new_tokens": 8, **kwargs})
    still_works(target, draft)


def test_empty_and_malformed_prompts(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="empty prompt"):
        opttree.generate(target, torch.empty(1, 0, dtype=torch.long), draft)
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 96\)"):
        opttree.generate(target, torch.tensor([[3, 500]]), draft)
    with pytest.raises(ValueError, match=r"must have shape \(1, T\) or \(T,\)"):
        opttree.generate(target, torch.ones(1, 2, 3, dtype=torch.long), draft)
    with pytest.raises(ValueError, match="must be in"):  # a batch's rows are checked one by one
        opttree.generate(target, torch.tensor([[3, 5], [3, 500]]), draft)
    still_works(target, draft)


def test_mismatched_vocabularies(pair):
    target, _ = pair
    other = tiny_model("llama", vocab=200, hidden=32, layers=1)  # 100 would pass as padding (test_padded_vocab.py)
    with pytest.raises(ValueError, match="vocabularies differ .*: target has 96 tokens, draft has 200"):
        opttree.generate(target, PROMPT, other, max_new_tokens=8)
    with pytest.raises(ValueError, match="needs a draft model"):
        opttree.generate(target, PROMPT, None, tree="opt", drafter="model", max_new_tokens=8)


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
    windowed = tiny_model("mistral", seed=4, sliding_window=16)  # a sliding window is no longer refused:
    out = opttree.generate(windowed, PROMPT, draft, budget=4, max_new_tokens=20, eos_token_id=[])  # it is crossed
    assert torch.equal(out.sequences, hf_greedy(windowed, PROMPT, 20))
    linear = tiny_model("llama", seed=5)
    linear.config.layer_types = ["full_attention", "linear_attention"]  # declared, but the model has no such layer
    with pytest.raises(NotImplementedError, match="exactness check for chain verification"):
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


def test_transformers_spellings_and_scalar_types(pair):
    """numpy / tensor scalars, a BatchEncoding, do_sample, max_length and an all-ones attention_mask
    mean what they mean in transformers; float token ids and a too-short max_length are refused."""
    import numpy as np
    from transformers import BatchEncoding

    target, draft = pair
    ref = hf_greedy(target, PROMPT, 12)
    encoding = BatchEncoding({"input_ids": PROMPT, "attention_mask": torch.ones_like(PROMPT)})
    out = opttree.generate(target, encoding, draft, budget=np.int64(4), delta=np.float32(0.1), max_length=16,
                           do_sample=False, eos_token_id=torch.tensor(95), seed=np.uint64(3))
    assert torch.equal(out.sequences, ref) and out.stats.new_tokens == 12
    out = opttree.generate(target, PROMPT, draft, max_new_tokens=torch.tensor(12), attention_mask=torch.ones_like(PROMPT),
                           eos_token_id=np.array([95, 94]))
    assert torch.equal(out.sequences, ref)
    with pytest.raises(ValueError, match="input_ids must be integer token ids, got dtype torch.float32"):
        opttree.generate(target, PROMPT.float(), draft, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_length=3 leaves no room after the 4-token prompt"):
        opttree.generate(target, PROMPT, draft, max_length=3)
    with pytest.raises(NotImplementedError, match="num_beams > 1"):
        opttree.generate(target, PROMPT, draft, num_beams=2)
    still_works(target, draft)


@pytest.mark.parametrize("bad,message", [
    (lambda logq: logq * 3 + 1, "return log-probabilities .*not raw logits"),
    (lambda logq: logq.index_fill(-1, torch.tensor([4]), float("inf")), "NaN or \\+inf"),
    (lambda logq: logq[..., :-2], "returned 94 scores per row; the target's vocabulary has 96"),
])
def test_a_custom_drafter_with_malformed_output(pair, bad, message):
    from helpers import ScriptedDrafter

    class Broken(ScriptedDrafter):
        def root(self, committed):
            return bad(super().root(committed))

    target, draft = pair
    with pytest.raises(ValueError, match=message):
        opttree.generate(target, PROMPT, Broken(96), max_new_tokens=8)
    still_works(target, draft)
