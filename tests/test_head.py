"""The EAGLE-style feature head: exact output with every policy and source it combines with,
the target's features handed over as the engine promises, clear refusals, and training that learns."""

import numpy as np
import pytest
import torch
from helpers import chi_square_pvalue, exact_joint, hf_greedy, sample_counts, tiny_model

import opttree
from opttree.step.cache import truncate
from opttree.step.drafters.head import FeatureHead, HeadDrafter, head_config, load_head


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
    wrong = FeatureHead(head_config(target), layers=(1, 9)).save(tmp_path / "deep", target)  # the target has 2
    with pytest.raises(ValueError, match=r"reads layers \[1, 9\], past the target's 2"):
        opttree.generate(target, torch.tensor([[1, 2, 3]]), drafter="head", head=wrong, max_new_tokens=4)


@pytest.mark.parametrize("recipe", ["eagle3", "eagle1"])
def test_training_raises_held_out_acceptance(tmp_path, recipe):
    """300 steps on text a tiny random target writes: the head agrees with the target's top token far
    more often than before (measured: 0 % before; eagle3 7 %, eagle1 15 % after; chance is 1 %)."""
    from opttree.train.head import RECIPES, held_out_acceptance, train_head, written_text
    from opttree.train.lm import TrainConfig, eval_windows

    target = tiny_model(seed=3, init=0.5).requires_grad_(False)
    corpus = np.random.default_rng(0).integers(3, 96, 4000)
    text = written_text(target, corpus, texts=24, eos=2, prompt_len=8, new_tokens=56, batch=8, log=lambda *_: None)
    windows = eval_windows(text, 32, 8)
    before = held_out_acceptance(FeatureHead(head_config(target)), target, windows)["heldout_top1"]
    cfg = TrainConfig(run_dir=tmp_path / "run", seq_len=32, batch_size=8, lr=3e-3, warmup_steps=5, steps=300,
                      eval_every=300, eval_windows=8, bf16=False)
    head, metrics = train_head(target, text, text, cfg, tmp_path / "head", RECIPES[recipe], log=lambda *_: None)
    assert metrics["heldout_top1"] > before + 0.05, (before, metrics)
    loaded = load_head(tmp_path / "head", target)
    out = opttree.generate(target, torch.tensor([[5, 9, 13]]), drafter="head", head=tmp_path / "head", budget=6,
                           max_new_tokens=24, eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(target, torch.tensor([[5, 9, 13]]), 24))
    assert isinstance(loaded, FeatureHead) and loaded.fc.weight.dtype == torch.float32
    assert loaded.temperature == metrics["temperature"] != 1.0  # calibrated on the held-out text, saved with it


@pytest.mark.parametrize("layers", [(-1,), (1, 2)])
def test_training_time_test_matches_drafting(setup, tmp_path, layers):
    """Brute force for the training-time test: pass k's output at position t equals what the drafter
    computes for a chain k levels below a root at t - k (true features up to the root, its own below)."""
    from opttree.train.head import unrolled

    target = setup[0]
    torch.manual_seed(5)
    head = FeatureHead(head_config(target), layers)
    drafter = HeadDrafter(head.eval(), target, target.config.vocab_size)
    tokens = torch.tensor([3, 9, 4, 17, 5, 30, 8, 11, 2, 6])
    with torch.no_grad():
        outputs, _, _ = unrolled(head, target, tokens[None], passes=3)
        root = 5
        hidden = target(tokens[None, :root], output_hidden_states=True).hidden_states
        drafter.start(tokens[: root + 1])
        drafter.seed_hidden(tuple(h[0] for h in hidden))
        drafter.root(tokens[: root + 1])
        drafter.expand(tokens[root + 1 : root + 2], torch.tensor([-1]))  # depth 1: the true next token
        drafter.expand(tokens[root + 2 : root + 3], torch.tensor([0]))  # depth 2, below it
    for k in range(3):
        assert torch.allclose(drafter.slot_features[k], outputs[k][0, root + k], atol=1e-5), k


def test_a_draft_vocabulary_keeps_output_exact(setup, tmp_path):
    """EAGLE-3's draft vocabulary: only the kept ids are drafted (the others get probability 0), their
    log-probabilities renormalised over the kept rows; greedy and sampled output stay the target's."""
    from opttree.step.drafters.head import DraftLMHead

    target = setup[0]
    torch.manual_seed(2)
    head = FeatureHead(head_config(target))
    head.draft_vocab = [1, 5, 7, 9, 11, 13, 40]
    folder = head.save(tmp_path / "h", target)
    assert load_head(folder, target).draft_vocab == head.draft_vocab
    lm_head = target.get_output_embeddings()
    features = torch.randn(3, target.config.hidden_size)
    log_q = DraftLMHead(lm_head, target.config.vocab_size, head.draft_vocab)(features, 0.7)
    expected = torch.log_softmax(lm_head(features)[:, head.draft_vocab] / 0.7, dim=-1)
    assert torch.allclose(log_q[:, head.draft_vocab], expected, atol=1e-5)
    assert torch.isinf(log_q).sum() == 3 * (target.config.vocab_size - 7)
    prompt = torch.tensor([[1, 5, 7, 9, 11, 13]])
    out = opttree.generate(target, prompt, drafter="head", head=folder, budget=8, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 24))


def test_sampling_with_a_draft_vocabulary_follows_the_target(tmp_path):
    target = tiny_model("llama", vocab=5, hidden=32, layers=1, seed=11, init=0.6)
    torch.manual_seed(0)
    head = FeatureHead(head_config(target))
    head.draft_vocab = [0, 3]  # the target's other ids are never drafted: they come from the residual
    folder = head.save(tmp_path, target)
    prompt, runs = torch.tensor([[1, 3, 0, 4, 1, 3]]), 1000
    counts = sample_counts(target, None, prompt, 2, runs, tree="opt", drafter="head", head=folder, budget=6,
                           max_depth=2, temperature=1.0)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 2, temperature=1.0), runs) > 1e-3


@pytest.mark.parametrize("temperature,drafts_at", [(0.0, 0.4), (0.7, 1.0), (1.0, 1.0)])
def test_the_head_drafts_at_its_calibrated_temperature_only_when_greedy(tmp_path, temperature, drafts_at):
    """The calibrated temperature fits greedy acceptance; when sampling, the head drafts from its own
    distribution (temperature 1, then warped like the target's), which its training matched to the target's:
    the root's draft log-probabilities are the LM head's over the head's output at that temperature."""
    target = tiny_model(seed=0)
    torch.manual_seed(0)
    head = FeatureHead(head_config(target))
    head.temperature = 0.4
    folder = head.save(tmp_path / "head", target)
    run = opttree.stream(target, torch.tensor([[1, 5, 7, 9]]), tree="opt", drafter="head", head=folder, budget=4,
                         max_new_tokens=4, temperature=temperature, seed=0)
    next(iter(run))
    drafter = run.drafter.first  # the sources' distribution source
    assert isinstance(drafter, HeadDrafter) and drafter.temperature == drafts_at
    features = torch.randn(2, target.config.hidden_size)
    expected = torch.log_softmax(target.get_output_embeddings()(features).float() / drafts_at, dim=-1)
    assert torch.allclose(drafter._log_probs(features), expected, atol=1e-5)


@pytest.mark.parametrize("layers", [(-1,), (1, 2)])
def test_head_forward_computes_the_heads_own_forward(setup, layers, monkeypatch):
    """`HeadForward` (the head's forward in fewer ops) against the head's own forward in float32: a block of 5 nodes
    under a tree mask after a cached prefix, then one node of its own outputs under causal attention (a chain's next
    node): the same outputs and the same cached keys and values; off with OPTTREE_DRAFT_FORWARD=0 and in training;
    a changed weight is copied again."""
    from opttree.step.cache import new_cache
    from opttree.step.draft_forward import HeadForward, head_forward

    target = setup[0]
    torch.manual_seed(3)
    head = FeatureHead(head_config(target), layers).eval()
    lean = head_forward(head)
    assert isinstance(lean, HeadForward)
    width, hidden = len(layers) * target.config.hidden_size, target.config.hidden_size
    cached, block = 7, 5
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, cached + block, width, generator=generator)
    embeds = torch.randn(1, cached + block + 1, hidden, generator=generator)
    positions = torch.arange(cached + block + 1)[None]
    allowed = torch.ones(block, cached + block, dtype=torch.bool)
    allowed[:, cached:] = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                        [1, 0, 1, 0, 1]], dtype=torch.bool)  # a tree: node 3 under 1, 4 under 2
    results = []
    with torch.inference_mode():
        for forward in (head, lean):
            cache = new_cache()
            forward(features[:, :cached], embeds[:, :cached], positions[:, :cached], None, cache)
            tree = forward(features[:, cached:], embeds[:, cached:-1], positions[:, cached:-1], allowed, cache)
            truncate(cache, cached + 2)  # keep the root's first child and its child 3: a chain
            own = forward(tree[:, 3:4].float(), embeds[:, -1:], positions[:, -1:], None, cache, own=True)
            results.append((tree.float(), own.float(), cache.layers[0].keys.float(), cache.layers[0].values.float()))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("OPTTREE_DRAFT_FORWARD", "0")
    assert head_forward(head) is None
    monkeypatch.delenv("OPTTREE_DRAFT_FORWARD")
    assert head_forward(head.train()) is None and head_forward(head.eval()) is lean
    with torch.no_grad():
        head.fc.weight.mul_(2)
    assert head_forward(head) is not lean


def test_the_head_extends_a_chain_as_expand_under_the_last_slot(setup, monkeypatch):
    """`HeadDrafter.extend` (causal attention, no tree mask) against `expand` of the same node under the last slot,
    along a chain of 4 from the root: the same distributions and slot features; a chain policy's step asks `extend`
    for its layers, never `expand`."""
    from opttree.settings.config import SpecConfig
    from opttree.step.policies.chain import Chain

    target = setup[0]
    torch.manual_seed(5)
    head = FeatureHead(head_config(target), (1, 2)).eval()
    committed = torch.tensor([3, 9, 4, 17, 5, 30, 8])
    with torch.no_grad():
        hidden = target(committed[None, :-1], output_hidden_states=True).hidden_states
    drafters = [HeadDrafter(head, target, target.config.vocab_size) for _ in range(2)]
    with torch.inference_mode():
        for drafter in drafters:
            drafter.start(committed)
            drafter.seed_hidden(tuple(h[0] for h in hidden))
            drafter.root(committed)
        for depth, token in enumerate(torch.tensor([5, 17, 40, 2])):
            got = drafters[0].extend(token.view(1))
            want = drafters[1].expand(token.view(1), torch.tensor([depth - 1]))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(drafters[0].slot_features, drafters[1].slot_features, atol=1e-5, rtol=1e-5)
    calls = []
    monkeypatch.setattr(HeadDrafter, "expand", lambda self, *a: calls.append("expand"))
    with torch.inference_mode():
        drafters[0].start(committed)
        drafters[0].seed_hidden(tuple(h[0] for h in hidden))
        tree = Chain(SpecConfig(tree="chain", budget=3)).build(drafters[0], committed, 3)
    assert len(tree) == 3 and calls == [] and drafters[0].slots.size == 2  # two nodes ran, the leaf did not
