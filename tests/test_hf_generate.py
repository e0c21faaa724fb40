"""transformers' own generate() as an entry point: target.generate(..., custom_generate=opttree.custom_generate)."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

import opttree
from opttree.genconfig import sampling_settings

PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def pair():
    target, draft, tok = opttree.demo_models(torch.float32)
    return target, draft, tok, tok(PROMPT, return_tensors="pt")


def test_greedy_output_and_stats_are_opttree_generate_and_transformers_own(pair):
    target, draft, tok, enc = pair
    own = target.generate(**enc, do_sample=False, max_new_tokens=40)
    ours = target.generate(**enc, custom_generate=opttree.custom_generate, assistant_model=draft, do_sample=False,
                           max_new_tokens=40, budget=6)
    assert torch.equal(ours, own)
    direct = opttree.generate(target, enc.input_ids, draft, max_new_tokens=40, budget=6, temperature=0)
    assert torch.equal(direct.sequences, ours)
    stats = opttree.custom_generate.stats
    assert (stats.steps, stats.new_tokens) == (direct.stats.steps, direct.stats.new_tokens) and stats.steps < 40
    train_free = target.generate(**enc, custom_generate=opttree.custom_generate, max_new_tokens=40, do_sample=False)
    assert torch.equal(train_free, own) and opttree.custom_generate.stats.steps < 40


def test_sampling_settings_come_from_the_prepared_warpers():
    warpers = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(5), TopPLogitsWarper(0.9)]
    assert sampling_settings(warpers, do_sample=True) == dict(temperature=0.7, top_k=5, top_p=0.9)
    assert sampling_settings([], do_sample=False) == dict(temperature=0.0, top_k=0, top_p=1.0)


def test_sampled_output_is_opttree_generate_with_the_same_settings(pair):
    target, draft, tok, enc = pair
    kwargs = dict(max_new_tokens=24, temperature=0.7, top_k=20, top_p=0.9)
    ours = target.generate(**enc, custom_generate=opttree.custom_generate, assistant_model=draft, do_sample=True,
                           seed=11, **kwargs)
    assert torch.equal(ours, opttree.generate(target, enc.input_ids, draft, seed=11, **kwargs).sequences)
    torch.manual_seed(5)
    first = target.generate(**enc, custom_generate=opttree.custom_generate, do_sample=True, **kwargs)
    torch.manual_seed(5)
    assert torch.equal(first, target.generate(**enc, custom_generate=opttree.custom_generate, do_sample=True, **kwargs))


def test_streamers_get_the_prompt_then_every_chunk(pair):
    target, draft, tok, enc = pair

    class Collect:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    out = target.generate(**enc, custom_generate=opttree.custom_generate, assistant_model=draft, max_new_tokens=30,
                          do_sample=False, streamer=streamer)
    assert streamer.ended and streamer.puts[0] == enc.input_ids[0].tolist()
    assert sum(streamer.puts, []) == out[0].tolist()


class Never(StoppingCriteria):
    """A stopping criterion opttree does not know."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("kwargs,named", [
    (dict(guidance_scale=1.5), "UnbatchedClassifierFreeGuidanceLogitsProcessor"),
    (dict(stopping_criteria=StoppingCriteriaList([Never()])), "Never"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    (dict(budget=0), "budget"),
])
def test_what_it_would_not_apply_is_refused_by_name(pair, kwargs, named):
    target, draft, tok, enc = pair
    with pytest.raises(ValueError, match=named):
        target.generate(**enc, custom_generate=opttree.custom_generate, assistant_model=draft,
                        **{"do_sample": False, "max_new_tokens": 8, **kwargs})


def test_the_prepared_processors_are_applied_at_every_node(pair):
    target, draft, tok, enc = pair
    settings = dict(do_sample=False, max_new_tokens=40, repetition_penalty=1.4, no_repeat_ngram_size=3)
    ours = target.generate(**enc, custom_generate=opttree.custom_generate, assistant_model=draft, budget=8, **settings)
    assert torch.equal(ours, target.generate(**enc, **settings))
    assert not torch.equal(ours, target.generate(**enc, do_sample=False, max_new_tokens=40))


def test_return_dict_in_generate_gives_the_sequences(pair):
    target, draft, tok, enc = pair
    out = target.generate(**enc, custom_generate=opttree.custom_generate, assistant_model=draft, do_sample=False,
                          max_new_tokens=8, return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(**enc, do_sample=False, max_new_tokens=8))


def test_output_logits_are_transformers_own(pair):
    """The target's raw logits that predicted each new token, as `generate(output_logits=True)` returns them, through
    custom_generate and `opttree.generate` (trees of several nodes a step: the rows of the accepted nodes); sampled
    rows keep theirs too, the emitted token always one the logits allow."""
    target, draft, tok, enc = pair
    settings = dict(do_sample=False, max_new_tokens=24, output_logits=True, return_dict_in_generate=True)
    own = target.generate(**enc, **settings)
    ours = target.generate(**enc, custom_generate=opttree.custom_generate, assistant_model=draft, budget=6, **settings)
    assert torch.equal(ours.sequences, own.sequences) and opttree.custom_generate.stats.steps < 24
    assert len(ours.logits) == len(own.logits) == 24 and ours.logits[0].shape == own.logits[0].shape == (1, 8192)
    torch.testing.assert_close(torch.cat(ours.logits), torch.cat(own.logits), rtol=0, atol=2e-4)
    direct = opttree.generate(target, enc.input_ids, draft, max_new_tokens=24, budget=6, output_logits=True)
    assert torch.equal(direct.logits, torch.cat(ours.logits)) and direct.logits.dtype == torch.float32
    sampled = opttree.generate(target, [enc.input_ids[0], enc.input_ids[0, :3]], draft, max_new_tokens=16,
                               temperature=1.0, top_k=5, output_logits=True, eos_token_id=[])
    for out in sampled:
        assert out.logits.shape == (16, 8192)
        ranks = (out.logits > out.logits.gather(1, out.new_tokens[:, None])).sum(1)  # how many logits beat the token
        assert bool((ranks < 5).all())  # within the top 5 of the row that predicted it
    assert opttree.generate(target, enc.input_ids, draft, max_new_tokens=4).logits is None
    with pytest.raises(ValueError, match="output_logits / output_scores for one sequence, not a batch"):
        target.generate(**{k: v.expand(2, -1) for k, v in enc.items()}, custom_generate=opttree.custom_generate,
                        **settings)


@pytest.mark.parametrize("settings", [dict(do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3),
                                      dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05)])
def test_output_scores_are_transformers_own(pair, settings):
    """generate's scores: each new token's logits through the processors (with its own context) and, sampling, the
    warpers; greedy, the same tokens, so the scores of transformers' own run."""
    target, draft, tok, enc = pair
    common = dict(max_new_tokens=20, output_scores=True, output_logits=True, return_dict_in_generate=True, **settings)
    ours = target.generate(**enc, custom_generate=opttree.custom_generate, assistant_model=draft, budget=6, seed=3,
                           **common)
    if settings["do_sample"]:  # transformers draws other tokens: its scores for ours, warped as it warps them
        warpers = target._get_logits_processor(target.generation_config.__class__(**settings))
        expected = [warpers(None, logits) for logits in ours.logits]
    else:
        own = target.generate(**enc, **common)
        assert torch.equal(ours.sequences, own.sequences)
        expected = own.scores
    assert len(ours.scores) == len(expected) == 20
    torch.testing.assert_close(torch.cat(ours.scores), torch.cat(expected), rtol=0, atol=2e-4)
    assert not torch.equal(torch.cat(ours.scores), torch.cat(ours.logits))  # processed: not the raw logits
    assert bool(torch.isinf(torch.cat(ours.scores)).any()) == settings["do_sample"]  # warped: filtered tokens -inf
