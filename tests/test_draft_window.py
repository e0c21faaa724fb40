"""The draft model over a window of the last positions (`draft_window`): it drafts as the model over those
positions alone, the output stays the target's own, and the setting is checked."""

import pytest
import torch
from helpers import chi_square_pvalue, exact_joint, hf_greedy, sample_counts, tiny_model

import opttree
from opttree.step.cache import GrowingLayer, drop_front, new_cache
from opttree.step.drafters.model import WINDOW_KEY, ModelDrafter, declared_window, model_drafter


def pair():
    target = tiny_model(seed=0, layers=2, init=0.3)
    draft = tiny_model(seed=1, layers=1, init=0.3)
    return target, draft


def window_reference(draft, committed: torch.Tensor, start: int, extra: torch.Tensor | None = None) -> torch.Tensor:
    """The draft's own log-probabilities after committed[start:] (and `extra`), at their absolute positions."""
    ids = committed[start:] if extra is None else torch.cat([committed[start:], extra])
    positions = torch.arange(start, start + ids.shape[0])
    with torch.inference_mode():
        logits = draft(input_ids=ids[None], position_ids=positions[None]).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("lean", ["1", "0"])  # the draft's own lean forward, and the model's forward
def test_a_sliding_draft_drafts_as_the_model_over_its_window(lean, monkeypatch):
    monkeypatch.setenv("OPTTREE_DRAFT_FORWARD", lean)
    _, draft = pair()
    window = 24
    drafter = ModelDrafter(draft, window=window)
    sequence = torch.randint(3, 96, (140,), generator=torch.Generator().manual_seed(0))
    drafter.start(sequence[:60][None])
    drops = 0
    for end in range(60, 140, 7):  # roots of growing committed sequences: the cache slides along
        committed = sequence[:end]
        got = drafter.root(committed)  # (V,)
        held = drafter.committed_len - drafter.dropped
        assert drafter.committed_len == end and held <= window and drafter.cache.get_seq_length() == held
        drops += drafter.dropped > 0
        torch.testing.assert_close(got, window_reference(draft, committed, drafter.dropped), atol=2e-5, rtol=1e-5)
        if end % 2:  # a tree layer of two nodes under the root
            tokens = torch.tensor([5, 9])
            layer = drafter.expand(tokens, torch.tensor([-1, -1]))  # (2, V)
            for i, token in enumerate(tokens):
                want = window_reference(draft, committed, drafter.dropped, token[None])
                torch.testing.assert_close(layer[i], want, atol=2e-5, rtol=1e-5)
        else:  # a chain of two nodes
            drafter.extend(torch.tensor([9]))
            chain = drafter.extend(torch.tensor([11]))  # (1, V)
            want = window_reference(draft, committed, drafter.dropped, torch.tensor([9, 11]))
            torch.testing.assert_close(chain[0], want, atol=2e-5, rtol=1e-5)
    assert drops >= 5  # the first root (60 tokens) already started past the window


def test_a_prompt_longer_than_the_window_prefills_only_seven_eighths_of_it():
    _, draft = pair()
    drafter = ModelDrafter(draft, window=16)
    prompt = torch.randint(3, 96, (50,), generator=torch.Generator().manual_seed(1))
    drafter.start(prompt[None])
    drafter.root(prompt)
    assert drafter.dropped == 36 and drafter.cache.get_seq_length() == 14  # 16 * 7 // 8


def test_dropping_a_growing_caches_front_keeps_writing_in_place():
    cache = new_cache()
    keys = torch.randn(1, 2, 10, 4)
    cache.update(keys, keys + 1, 0)
    layer = cache.layers[0]
    assert isinstance(layer, GrowingLayer) and layer.holds_views()
    drop_front(cache, 6)
    assert layer.holds_views() and cache.get_seq_length() == 4  # views of what is left of the buffers
    more = torch.randn(1, 2, 3, 4)
    got, values = cache.update(more, more + 1, 0)
    torch.testing.assert_close(got, torch.cat([keys[:, :, 6:], more], dim=2))
    torch.testing.assert_close(values, torch.cat([keys[:, :, 6:], more], dim=2) + 1)


@pytest.mark.parametrize("tree,budget", [("opt", 12), ("chain", 3), ("eagle2", 8), ("dyspec", 8)])
def test_greedy_output_is_the_targets_with_a_small_window(tree, budget):
    target, draft = pair()
    prompt = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    reference = hf_greedy(target, prompt, 48)
    for window in (8, 20):
        out = opttree.generate(target, prompt, draft, tree=tree, budget=budget, max_new_tokens=48, eos_token_id=[],
                               draft_window=window)
        assert torch.equal(out.sequences, reference), (tree, window)


def test_a_batch_drafting_together_keeps_the_targets_output():
    target, draft = pair()
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in (12, 45, 30)]
    outs = opttree.generate(target, prompts, draft, budget=8, max_new_tokens=32, eos_token_id=[], draft_window=16)
    for prompt, out in zip(prompts, outs):
        assert torch.equal(out.sequences, hf_greedy(target, prompt[None], 32))


@pytest.mark.parametrize("tree", ["opt", "chain"])
def test_sampled_tokens_follow_the_target_distribution_with_a_window(tree):
    """A 4-token prompt, a window of 2: the draft slides at every step; the first 3 tokens still follow the
    target's exact distribution (`tests/test_distribution.py`'s check)."""
    target = tiny_model("llama", vocab=5, hidden=32, layers=1, seed=11, init=0.6)
    draft = tiny_model("llama", vocab=5, hidden=32, layers=1, seed=12, init=0.6)
    prompt = torch.tensor([[1, 3, 0, 4]])
    exact = exact_joint(target, prompt, 3)
    counts = sample_counts(target, draft, prompt, 3, 1000, tree=tree, budget=4 if tree == "opt" else 2, delta=0.0,
                           max_depth=3, temperature=1.0, draft_window=2)
    assert chi_square_pvalue(counts, exact, 1000) > 1e-3


def test_the_window_is_declared_checked_and_refused_where_it_cannot_apply():
    target, draft = pair()
    assert declared_window(draft) is None and model_drafter(draft).draft_window is None
    draft.config.update({WINDOW_KEY: 64})
    assert declared_window(draft) == 64 and model_drafter(draft).draft_window == 64  # the default
    assert model_drafter(draft, window=0).draft_window is None and model_drafter(draft, window=9).draft_window == 9
    prompt = torch.randint(3, 96, (1, 10))
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="draft_window"):
            opttree.generate(target, prompt, draft, max_new_tokens=4, draft_window=bad)
    with pytest.raises(ValueError, match="static path"):
        model_drafter(draft, static_positions=64, window=32)
    sliding = tiny_model("mistral", seed=1, layers=1, sliding_window=16)
    sliding.config.update({WINDOW_KEY: 64})
    assert model_drafter(sliding).draft_window is None  # its layers keep their own windows
    with pytest.raises(ValueError, match="sliding-window layers"):
        model_drafter(sliding, window=32)
    draft.config.update({WINDOW_KEY: 0})
    with pytest.raises(ValueError, match=WINDOW_KEY):
        declared_window(draft)


def test_the_shipped_draft_declares_its_window():
    _, draft, _ = opttree.demo_models(dtype=torch.float32)
    assert declared_window(draft) == 256
