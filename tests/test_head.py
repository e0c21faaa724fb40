"""The EAGLE-style feature head (issue 11): exact output with every policy and source it combines with,
the target's features handed over as the engine promises, clear refusals, and training that learns."""

import numpy as np
import pytest
import torch
from helpers import chi_square_pvalue, exact_joint, hf_greedy, sample_counts, tiny_model

import opttree
from opttree.drafters.head import FeatureHead, HeadDrafter, head_config, load_head


def random_head(target, folder, seed: int = 0):
    torch.manual_seed(seed)
    return FeatureHead(head_config(target)).save(folder, target)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = tiny_model(seed=0)
    draft = tiny_model(seed=1, hidden=32, layers=1)
    return target, draft, random_head(target, tmp_path_factory.mktemp("head"))


@pytest.mark.parametrize("tree,drafter,with_model,prompt", [
    ("opt", "head", False, [4]),  # a one-token prompt: no feature before the root
    ("opt", "head+lookup", False, [1, 5, 7, 9, 11, 13]), ("chain", "head", False, [1, 5, 7, 9, 11, 13]),
    ("dyspec", "head+recycling", False, [1, 5, 7, 9, 11, 13]), ("opt", "model+head", True, [1, 5, 7, 9, 11, 13]),
])
def test_greedy_output_is_exact_with_the_head(setup, tree, drafter, with_model, prompt):
    target, draft, head = setup
    prompt = torch.tensor([prompt])
    out = opttree.generate(target, prompt, draft if with_model else None, tree=tree, drafter=drafter, head=head,
                           budget=8, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 24)), (tree, drafter, prompt.shape)


@pytest.mark.parametrize("tree,warp", [("opt", {"temperature": 0.8, "top_k": 3})])
def test_sampled_tokens_follow_the_target_distribution(tmp_path, tree, warp):
    target = tiny_model("llama", vocab=5, hidden=32, layers=1, seed=11, init=0.6)
    head = random_head(target, tmp_path)
    prompt, runs = torch.tensor([[1, 3, 0, 4, 1, 3]]), 1000
    counts = sample_counts(target, None, prompt, 2, runs, tree=tree, drafter="head", head=head, budget=6,
                           max_depth=2, **warp)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 2, **warp), runs) > 1e-3


def test_the_head_gets_the_targets_features_of_every_committed_token(setup):
    """Brute force: after a generation the drafter holds, for each committed token but the last, the
    target's last hidden state from one plain causal forward over the whole sequence."""
    target, _, head = setup
    seen = []
    original = HeadDrafter.root

    def spy(self, committed):  # the features handed over since the last step, accumulated
        handed = self.pending.clone() if not seen else torch.cat([seen[-1][1], self.pending])
        seen.append((committed.clone(), handed))
        return original(self, committed)

    HeadDrafter.root = spy
    try:
        opttree.generate(target, torch.tensor([[1, 5, 7, 9]]), drafter="head", head=head, budget=6, max_new_tokens=24,
                         eos_token_id=[])
    finally:
        HeadDrafter.root = original
    committed, features = seen[-1]
    with torch.no_grad():
        expected = target(committed[None], output_hidden_states=True).hidden_states[-1][0, :-1]
    assert len(seen) > 2 and features.shape == expected.shape
    assert torch.allclose(features, expected, atol=1e-4)


def test_refusals_name_the_problem(setup, tmp_path):
    target, _, head = setup
    other = tiny_model(seed=7)
    with pytest.raises(ValueError, match="trained for another target"):
        opttree.generate(other, torch.tensor([[1, 2, 3]]), drafter="head", head=head, max_new_tokens=4)
    with pytest.raises(ValueError, match="not a saved head"):
        opttree.generate(target, torch.tensor([[1, 2, 3]]), drafter="head", head=tmp_path, max_new_tokens=4)
    with pytest.raises(ValueError, match="opttree train head"):
        opttree.generate(target, torch.tensor([[1, 2, 3]]), drafter="head", max_new_tokens=4)


def test_training_raises_held_out_acceptance(tmp_path):
    """300 steps on text a tiny random target writes: the head agrees with the target's top token far
    more often than before (measured: 0.4 % -> 12 %; chance is 1 %)."""
    from opttree.train.head import held_out_acceptance, train_head, written_text
    from opttree.train.lm import TrainConfig, eval_windows

    target = tiny_model(seed=3, init=0.5).requires_grad_(False)
    corpus = np.random.default_rng(0).integers(3, 96, 4000)
    text = written_text(target, corpus, texts=24, eos=2, prompt_len=8, new_tokens=56, batch=8, log=lambda *_: None)
    windows = eval_windows(text, 32, 8)
    before = held_out_acceptance(FeatureHead(head_config(target)), target, windows)["heldout_top1"]
    cfg = TrainConfig(run_dir=tmp_path / "run", seq_len=32, batch_size=8, lr=3e-3, warmup_steps=5, steps=300,
                      eval_every=300, eval_windows=8, bf16=False)
    head, metrics = train_head(target, text, text, cfg, tmp_path / "head", log=lambda *_: None)
    assert metrics["heldout_top1"] > before + 0.08, (before, metrics)
    loaded = load_head(tmp_path / "head", target)
    out = opttree.generate(target, torch.tensor([[5, 9, 13]]), drafter="head", head=tmp_path / "head", budget=6,
                           max_new_tokens=24, eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(target, torch.tensor([[5, 9, 13]]), 24))
    assert isinstance(loaded, FeatureHead) and loaded.fc.weight.dtype == torch.float32
    assert loaded.temperature == metrics["temperature"] != 1.0  # calibrated on the held-out text, saved with it
