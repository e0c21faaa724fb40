"""Greedy output is token-for-token transformers' greedy output, on several architectures."""

import pytest
import torch
from helpers import char_tokenizer as make_char_tokenizer
from helpers import hf_greedy, tiny_model

import opttree

ARCHS = ["llama", "qwen2", "mistral", "gpt_neox", "phi3"]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    target = tiny_model(request.param, seed=1, layers=2, hidden=64)
    draft = tiny_model(request.param, seed=2, layers=1, hidden=32)
    return request.param, target, draft


def prompts(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (1, int(torch.randint(1, 24, (1,), generator=g))), generator=g) for _ in range(n)]


@pytest.mark.parametrize("tree,budget,delta,depth", [
    ("opt", 1, 0.2, 8), ("opt", 4, 0.0, 3), ("opt", 16, 0.2, 8), ("opt", 64, 0.5, 12),
    ("chain", 1, 0.2, 8), ("chain", 4, 0.2, 8), ("ar", 1, 0.2, 8),
])
def test_greedy_identity(pair, tree, budget, delta, depth):
    _, target, draft = pair
    for prompt in prompts(4, seed=budget):
        ref = hf_greedy(target, prompt, 30, eos_token_id=None)
        out = opttree.generate(target, prompt, draft, tree=tree, budget=budget, delta=delta, max_depth=depth,
                               max_new_tokens=30, eos_token_id=[])
        assert torch.equal(out.sequences, ref), (tree, budget, prompt)
        assert out.stats.new_tokens == 30


@pytest.mark.parametrize("draft_temperature", [0.3, 3.0])
def test_greedy_identity_at_any_draft_temperature(pair, draft_temperature):
    """The draft temperature reshapes the tree (p-hat), never the output."""
    _, target, draft = pair
    for prompt in prompts(3, seed=5):
        ref = hf_greedy(target, prompt, 30, eos_token_id=None)
        out = opttree.generate(target, prompt, draft, budget=8, delta=0.05, max_new_tokens=30, eos_token_id=[],
                               draft_temperature=draft_temperature)
        assert torch.equal(out.sequences, ref)


def test_greedy_identity_with_the_target_as_its_own_draft(pair):
    _, target, _ = pair
    for prompt in prompts(4, seed=7):
        ref = hf_greedy(target, prompt, 40, eos_token_id=None)
        out = opttree.generate(target, prompt, target, tree="opt", budget=16, delta=0.0, max_depth=6,
                               max_new_tokens=40, eos_token_id=[])
        assert torch.equal(out.sequences, ref)
        assert out.stats.mean_accepted_length > 2.0


def chunks_of(target, draft, prompt, **kw):
    run = opttree.stream(target, prompt, draft, **kw)
    return [c.tolist() for c in run]


def test_eos_inside_an_accepted_chunk(pair):
    """Choose an EOS token whose first occurrence falls strictly inside an accepted chunk."""
    _, target, _ = pair
    checked = 0
    for prompt in prompts(12, seed=3):
        kw = dict(tree="opt", budget=16, delta=0.0, max_depth=6, max_new_tokens=40)
        chunks = chunks_of(target, target, prompt, eos_token_id=[], **kw)
        flat = [t for c in chunks for t in c]
        inside = [c[i] for c in chunks for i in range(len(c) - 1)]
        candidates = [t for t in inside if flat.index(t) < len(flat) - 1 and t in inside]
        # the first occurrence of the token must itself be inside a chunk
        firsts = [t for t in candidates if _inside_at_first(chunks, t)]
        if not firsts:
            continue
        eos = firsts[0]
        ref = hf_greedy(target, prompt, 40, eos_token_id=eos)
        out = opttree.generate(target, prompt, target, eos_token_id=eos, **kw)
        assert torch.equal(out.sequences, ref)
        assert out.sequences[0, -1].item() == eos
        checked += 1
    assert checked >= 3


def _inside_at_first(chunks, token):
    for c in chunks:
        if token in c:
            return c.index(token) < len(c) - 1
    return False


@pytest.fixture(scope="module")
def char_tokenizer():
    return make_char_tokenizer()


def test_stop_string_inside_an_accepted_chunk(pair, char_tokenizer):
    _, target, _ = pair
    checked = 0
    kw = dict(tree="opt", budget=16, delta=0.0, max_depth=6, max_new_tokens=40, eos_token_id=[])
    for prompt in prompts(12, seed=5):
        chunks = chunks_of(target, target, prompt, **kw)
        long = [c for c in chunks[1:] if len(c) >= 3]
        if not long:
            continue
        stop = char_tokenizer.decode(long[0][:2])  # ends inside a chunk, one token before its end or more
        expected = hf_greedy(target, prompt, 40, eos_token_id=None, stop_strings=stop,
                             tokenizer=char_tokenizer)[0, prompt.shape[1]:].tolist()
        assert len(expected) < 40
        out = opttree.generate(target, prompt, target, stop=stop, tokenizer=char_tokenizer, **kw)
        assert out.new_tokens.tolist() == expected
        assert out.stats.new_tokens == len(expected)
        checked += 1
    assert checked >= 3


def test_stream_yields_the_same_tokens_as_generate(pair):
    _, target, draft = pair
    prompt = prompts(1, seed=9)[0]
    run = opttree.stream(target, prompt, draft, budget=8, max_new_tokens=25, eos_token_id=[])
    streamed = torch.cat(list(run))
    out = opttree.generate(target, prompt, draft, budget=8, max_new_tokens=25, eos_token_id=[])
    assert torch.equal(streamed, out.new_tokens)
    assert run.stats.steps == out.stats.steps and sum(run.stats.accepted_histogram) == run.stats.steps


def test_confident_self_draft_reaches_max_depth_plus_one():
    """Target as its own draft, with near-certain predictions: every step accepts max_depth tokens."""
    target = tiny_model("llama", seed=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(200.0)  # sharpen every prediction
    max_depth = 6
    out = opttree.generate(target, prompts(1)[0], target, tree="opt", budget=8, delta=0.2, max_depth=max_depth,
                           max_new_tokens=(max_depth + 1) * 10, eos_token_id=[])
    assert out.stats.mean_accepted_length == max_depth + 1
    assert out.stats.accepted_histogram[max_depth] == 10


def test_interleaved_streams_in_one_thread(pair):
    """Two streams consumed round-robin (as an async server does) equal separate runs, and the
    caller's code between chunks runs with its own grad mode, not in inference mode."""
    _, target, draft = pair
    a, b = prompts(2, seed=11)
    refs = [opttree.generate(target, p, draft, budget=4, max_new_tokens=20, eos_token_id=[]).sequences for p in (a, b)]
    runs = [opttree.stream(target, p, draft, budget=4, max_new_tokens=20, eos_token_id=[]) for p in (a, b)]
    iterators, live = [iter(r) for r in runs], [True, True]
    while any(live):
        for i, it in enumerate(iterators):
            if live[i]:
                live[i] = next(it, None) is not None
                assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    for run, ref in zip(runs, refs):
        assert torch.equal(run.sequences, ref)
