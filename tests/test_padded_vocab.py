"""A draft whose embedding / LM head is padded (or shorter) but shares the target's tokenizer is used
over the target's vocabulary: extra draft columns dropped, missing ones impossible. Exact (fp32)."""

import pytest
import torch
from helpers import hf_greedy, tiny_model

import opttree
from opttree.step.drafters import ModelDrafter


@pytest.fixture(scope="module")
def shipped():
    return opttree.demo_models(dtype=torch.float32)


def resized_draft(rows: int):
    """The shipped draft with its token embeddings (and LM head) resized to `rows`."""
    _, draft, _ = opttree.demo_models(dtype=torch.float32)
    draft.resize_token_embeddings(rows)
    assert draft.get_output_embeddings().weight.shape[0] == rows
    return draft


@pytest.mark.parametrize("rows", [8256, 8000])
def test_shipped_target_with_a_padded_or_shorter_draft(shipped, rows):
    target, _, tokenizer = shipped
    draft = resized_draft(rows)
    text = tokenizer("def add(a, b):\n", return_tensors="pt").input_ids
    high = torch.tensor([[8100, 8150, 8191]])  # real tokens a shorter draft has no row for
    for prompt in (text, torch.cat([text, high], dim=1)):
        ref = hf_greedy(target, prompt, 24, eos_token_id=tokenizer.eos_token_id)
        for kw in (dict(budget=8), dict(budget=1, tree="chain")):
            out = opttree.generate(target, prompt, draft, max_new_tokens=24, **kw)
            assert torch.equal(out.sequences, ref), (rows, kw)
        assert out.stats.mean_accepted_length > 1.0  # the draft still helps


@pytest.mark.parametrize("draft_vocab", [104, 88])
def test_random_pairs_over_the_whole_vocabulary(draft_vocab):
    """Random models emit any of the target's 96 ids, those past a shorter draft's rows included."""
    target = tiny_model("llama", seed=1)
    draft = tiny_model("llama", vocab=draft_vocab, seed=2, layers=1, hidden=32)
    prompt = torch.tensor([[5, 93, 17, 95, 40]])
    ref = hf_greedy(target, prompt, 40)
    assert int(ref.max()) >= 88
    for budget in (1, 4, 16):
        out = opttree.generate(target, prompt, draft, budget=budget, max_new_tokens=40, eos_token_id=[])
        assert torch.equal(out.sequences, ref), budget
    sampled = opttree.generate(target, prompt, draft, budget=8, max_new_tokens=40, eos_token_id=[],
                               temperature=1.0, seed=0)
    assert sampled.stats.new_tokens == 40


def test_draft_log_probabilities_cover_exactly_the_targets_vocabulary():
    for rows in (104, 88):
        drafter = ModelDrafter(tiny_model("llama", vocab=rows, layers=1, hidden=32), vocab=96)
        logq = drafter.root(torch.tensor([5, 6, 7]))
        assert logq.shape == (96,)
        assert torch.logsumexp(logq, dim=-1).item() == pytest.approx(0.0, abs=1e-5)
        assert torch.isneginf(logq[rows:]).all() and torch.isfinite(logq[: min(rows, 96)]).all()


def test_vocabularies_that_differ_by_more_than_padding(shipped):
    target, _, tokenizer = shipped
    prompt = tokenizer("def add(a, b):\n", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="target has 8192 tokens, draft has 4096"):
        opttree.generate(target, prompt, resized_draft(4096), max_new_tokens=8)


@pytest.mark.parametrize("draft_vocab", [104, 88])
def test_calibration_with_a_padded_or_shorter_draft(draft_vocab):
    """`opttree calibrate`'s measurements: paired logits over the target's ids, and its timed runs."""
    from opttree.alignment import fit_draft_temperature, paired_logits
    from opttree.calibration.measure import calibration_run

    target = tiny_model("llama", seed=1)
    draft = tiny_model("llama", vocab=draft_vocab, seed=2, layers=1, hidden=32)
    prompt = torch.tensor([5, 93, 17])
    [(t, d)] = list(paired_logits(target, draft, [prompt], temperature=0.0, new_tokens=6))
    assert t.shape == d.shape == (6, 96)
    shared = min(draft_vocab, 96)
    with torch.no_grad():
        ids = torch.cat([prompt, t.argmax(-1)]).clamp(max=draft_vocab - 1)
        assert torch.allclose(draft(input_ids=ids[None]).logits[0, 2:-1, :shared], d[:, :shared], atol=1e-5)
    assert torch.isneginf(d[:, shared:]).all()
    assert 0 < fit_draft_temperature([(t, d)], temperature=1.0) < 100
    plain, grid = calibration_run(target, draft, [prompt[None]], [4], [0.2], dict(max_new_tokens=8, eos_token_id=[]),
                                  progress=False)
    assert plain.new_tokens == grid[0].new_tokens == 8
