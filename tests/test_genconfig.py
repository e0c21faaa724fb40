"""The target's generation_config is honoured as target.generate honours it: its
logits processors are applied at every tree node with that node's own context, its sampling settings
fill in what the caller left out, and what opttree cannot apply exactly is refused by name."""

import pytest
import torch
from helpers import chi_square_pvalue, exact_joint, sample_counts, tiny_model
from transformers.generation import logits_process as lp

import opttree
from opttree.genconfig import shape_logits
from opttree.step.tree import DraftTree

PROMPT = torch.tensor([[1, 5, 7, 9, 11, 13]])
NEW = 30


@pytest.fixture(scope="module")
def models():
    return tiny_model(seed=0), tiny_model(seed=1, hidden=32, layers=1)


# each setting changes target.generate's greedy output for this tiny target (asserted below)
SETTINGS = [
    dict(repetition_penalty=1.5),
    dict(no_repeat_ngram_size=2),
    dict(bad_words_ids=[[50], [89, 83]]),
    dict(sequence_bias={(50,): -5.0}),
    dict(suppress_tokens=[50, 60]),
    dict(begin_suppress_tokens=[58]),
    dict(min_new_tokens=20, eos_token_id=60),
    dict(min_length=30, eos_token_id=60),
    dict(forced_eos_token_id=3),
    dict(exponential_decay_length_penalty=(5, 1.5), eos_token_id=60),
    dict(repetition_penalty=1.3, no_repeat_ngram_size=3, renormalize_logits=True),
]


def _reference(target, **kwargs):
    """target.generate's greedy output under the model's own generation_config (its EOS included)."""
    with torch.inference_mode():
        return target.generate(PROMPT, do_sample=False, max_new_tokens=NEW, pad_token_id=0, **kwargs)


def _with_config(model, **settings):
    saved = model.generation_config
    model.generation_config = saved.__class__.from_dict({**saved.to_dict(), **settings})
    return saved


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(s))
def test_generation_config_processors_are_applied_exactly(models, settings):
    target, draft = models
    plain = _reference(target)
    saved = _with_config(target, **settings)
    try:
        reference = _reference(target)
        assert not torch.equal(reference, plain), "the setting must change the output for the test to mean anything"
        for tree, drafter, budget in (("opt", draft, 8), ("opt", None, 16)):  # a draft model; recycling+lookup
            out = opttree.generate(target, PROMPT, drafter, tree=tree, budget=budget, max_new_tokens=NEW)
            assert torch.equal(out.sequences, reference), (tree, settings)
    finally:
        target.generation_config = saved


def test_a_users_logits_processor_is_applied_like_generates(models):
    target, draft = models
    extra = lp.LogitsProcessorList([lp.SuppressTokensLogitsProcessor([50, 60, 89])])
    reference = _reference(target, logits_processor=extra)
    out = opttree.generate(target, PROMPT, draft, budget=8, max_new_tokens=NEW, logits_processor=extra)
    assert torch.equal(out.sequences, reference)


def test_shape_logits_gives_each_node_its_own_context():
    """Brute force: every row processed alone, with committed + the path to its node as input_ids."""
    processors = [lp.RepetitionPenaltyLogitsProcessor(2.0), lp.NoRepeatNGramLogitsProcessor(2),
                  lp.MinNewTokensLengthLogitsProcessor(3, 3, eos_token_id=4)]
    committed = torch.tensor([1, 2, 3, 2])
    parents = torch.tensor([-1, -1, 0, 0, 2, 3])
    tokens = torch.tensor([3, 5, 2, 6, 4, 1])
    depths = torch.tensor([1, 1, 2, 2, 3, 3])
    tree = DraftTree(tokens, parents, depths, torch.zeros(6), torch.full((6,), -1))
    logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(0))
    shaped = shape_logits(processors, committed, tree, logits)
    paths = {-1: []}
    for i, (token, parent) in enumerate(zip(tokens.tolist(), parents.tolist())):
        paths[i] = paths[parent] + [token]
    for row in range(7):
        context = torch.cat([committed, torch.tensor(paths[row - 1], dtype=torch.long)])[None]
        expected = logits[row : row + 1].clone()
        for processor in processors:
            expected = processor(context, expected)
        assert torch.equal(shaped[row], expected[0]), row


def test_sampled_tokens_follow_the_processed_distribution():
    target = tiny_model("llama", vocab=5, hidden=32, layers=1, seed=11, init=0.6)
    draft = tiny_model("llama", vocab=5, hidden=32, layers=1, seed=12, init=0.6)
    prompt, runs = torch.tensor([[1, 3, 0, 4]]), 1000
    target.generation_config.repetition_penalty = 3.0
    exact = exact_joint(target, prompt, 2, processors=[lp.RepetitionPenaltyLogitsProcessor(3.0)])
    assert exact != exact_joint(target, prompt, 2)
    counts = sample_counts(target, draft, prompt, 2, runs, tree="opt", budget=4, delta=0.0, max_depth=2,
                           temperature=1.0)
    assert chi_square_pvalue(counts, exact, runs) > 1e-3


def test_sampling_settings_come_from_the_generation_config(models):
    """do_sample / temperature / top_k in the config are used where the caller passes none, as by generate."""
    target, draft = models
    saved = _with_config(target, do_sample=True, temperature=0.5, top_k=3)
    try:
        run = opttree.stream(target, PROMPT, draft, max_new_tokens=4)
        assert (run.config.temperature, run.config.top_k, run.config.top_p) == (0.5, 3, 1.0)
        assert opttree.stream(target, PROMPT, draft, max_new_tokens=4, temperature=0).config.greedy
        assert opttree.stream(target, PROMPT, draft, max_new_tokens=4, top_k=7).config.top_k == 7
    finally:
        target.generation_config = saved
    assert opttree.stream(target, PROMPT, draft, max_new_tokens=4).config.greedy


def test_a_max_length_in_the_config_counts_the_prompt_as_generate_reads_it(models):
    target, draft = models
    saved = _with_config(target, max_length=PROMPT.shape[1] + 5)
    try:
        with torch.inference_mode():
            hf = target.generate(PROMPT, do_sample=False, attention_mask=torch.ones_like(PROMPT))
        out = opttree.generate(target, PROMPT, draft)
        assert out.new_tokens.shape[0] == 5 and torch.equal(out.sequences, hf)
        assert opttree.generate(target, PROMPT, draft, max_new_tokens=7).new_tokens.shape[0] == 7  # the caller's wins
        with pytest.raises(ValueError, match="max_length=3 leaves no room after the 6-token prompt"):
            target.generation_config.max_length = 3
            opttree.generate(target, PROMPT, draft)
    finally:
        target.generation_config = saved


def test_sampling_without_a_top_k_keeps_the_top_k_generate_falls_back_on(models):
    """Neither the caller nor the config sets top_k: generate(do_sample=True) keeps its built-in 50 likeliest tokens,
    and so does opttree; top_k=0 asks for the whole distribution."""
    target, draft = models
    recorded = {}

    def record(model, input_ids, logits_processor=None, **_):
        recorded["processors"] = logits_processor
        return input_ids

    assert target.generation_config.top_k is None
    target.generate(PROMPT, do_sample=True, max_new_tokens=2, custom_generate=record,
                    attention_mask=torch.ones_like(PROMPT))
    generates = [p.top_k for p in recorded["processors"] if isinstance(p, lp.TopKLogitsWarper)]
    assert opttree.stream(target, PROMPT, draft, max_new_tokens=4, temperature=1.0).config.top_k == generates[0] == 50
    assert opttree.stream(target, PROMPT, draft, max_new_tokens=4, temperature=1.0, top_k=0).config.top_k == 0
    assert opttree.stream(target, PROMPT, draft, max_new_tokens=4).config.greedy  # greedy: no warper at all


@pytest.mark.parametrize("settings,named", [
    (dict(guidance_scale=1.5), "guidance_scale=1.5"),
    (dict(num_beams=2), "num_beams=2"),
    (dict(penalty_alpha=0.6), "penalty_alpha=0.6"),
    (dict(watermarking_config={"greenlist_ratio": 0.25}), "watermarking_config"),
    (dict(token_healing=True), "token_healing=True"),
])
def test_settings_it_cannot_apply_are_refused_by_name(models, settings, named):
    target, draft = models
    saved = _with_config(target, **settings)
    try:
        with pytest.raises(ValueError, match=named):
            opttree.generate(target, PROMPT, draft, max_new_tokens=4)
    finally:
        target.generation_config = saved


def test_max_time_ends_the_generation_with_a_prefix_of_its_untimed_output(models, monkeypatch):
    """From the caller, the generation_config and a custom_generate call: the step that ends past max_time (a clock
    that moves a second a reading) is the last, its tokens emitted whole."""
    target, draft = models
    untimed = opttree.generate(target, PROMPT, draft, max_new_tokens=NEW).sequences
    for clock_step, max_time in ((1.0, 2.5), (1.0, 6.5)):
        readings = iter(range(10**6))
        monkeypatch.setattr(opttree.engine.Stopper, "clock", staticmethod(lambda: clock_step * next(readings)))
        out = opttree.generate(target, PROMPT, draft, max_new_tokens=NEW, max_time=max_time)
        assert out.stats.steps == int(max_time) + 1  # the deadline is read at 0, each step's end at 1, 2, ...
        assert torch.equal(out.sequences[0], untimed[0, : out.sequences.shape[1]])
        assert out.sequences.shape[1] < untimed.shape[1]
    readings = iter(range(10**6))
    saved = _with_config(target, max_time=2.5)
    try:
        assert opttree.generate(target, PROMPT, draft, max_new_tokens=NEW).stats.steps == 3
        readings = iter(range(10**6))
        assert opttree.generate(target, PROMPT, draft, max_new_tokens=NEW, max_time=100.0).stats.steps > 3  # yours wins
    finally:
        target.generation_config = saved
    readings = iter(range(10**6))
    ours = target.generate(PROMPT, custom_generate=opttree.custom_generate, assistant_model=draft, do_sample=False,
                           max_new_tokens=NEW, max_time=2.5)
    assert opttree.custom_generate.stats.steps == 3 and torch.equal(ours[0], untimed[0, : ours.shape[1]])
    with pytest.raises(ValueError, match="max_time must be a finite number of seconds > 0"):
        opttree.generate(target, PROMPT, draft, max_new_tokens=NEW, max_time=0)


def test_stop_strings_in_the_generation_config_need_the_tokenizer(models):
    target, draft = models
    saved = _with_config(target, stop_strings=["xy"])
    try:
        with pytest.raises(ValueError, match="stop_strings"):
            opttree.generate(target, PROMPT, draft, max_new_tokens=4)
    finally:
        target.generation_config = saved


def test_a_generation_config_argument_replaces_the_targets(models):
    """generation_config=... as in target.generate(generation_config=...)."""
    target, draft = models
    custom = target.generation_config.__class__.from_dict({**target.generation_config.to_dict(),
                                                           "no_repeat_ngram_size": 2})
    reference = _reference(target, generation_config=custom)
    assert not torch.equal(reference, _reference(target))
    out = opttree.generate(target, PROMPT, draft, budget=8, max_new_tokens=NEW, generation_config=custom)
    assert torch.equal(out.sequences, reference)
