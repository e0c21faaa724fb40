"""EESD early-exit self-drafting: exact output with every policy and source it combines
with, the target's own first layers and cache (never written), clear refusals, and training that learns."""

import numpy as np
import pytest
import torch
from helpers import chi_square_pvalue, exact_joint, hf_greedy, sample_counts, tiny_model

import opttree
from opttree.step.drafters.early_exit import EarlyExitDrafter, ExitLayer, load_early_exit

PROMPT = [1, 5, 7, 9, 11, 13]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = tiny_model(seed=0, layers=3)
    draft = tiny_model(seed=1, hidden=32, layers=1)
    return target, draft, ExitLayer(target, 1).save(tmp_path_factory.mktemp("exit"), target)


@pytest.mark.parametrize("tree,drafter,with_model,prompt", [
    ("opt", "early-exit", False, [4]),  # a one-token prompt: the target's cache is empty at the first root
    ("opt", "early-exit+lookup", False, PROMPT), ("chain", "early-exit", False, PROMPT),
    ("dyspec", "early-exit+recycling", False, PROMPT), ("opt", "model+early-exit", True, PROMPT),
])
def test_greedy_output_is_exact_with_early_exit(setup, tree, drafter, with_model, prompt):
    target, draft, folder = setup
    prompt = torch.tensor([prompt])
    out = opttree.generate(target, prompt, draft if with_model else None, tree=tree, drafter=drafter,
                           early_exit=folder, budget=8, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 24)), (tree, drafter, prompt.shape)


@pytest.mark.parametrize("arch, extra", [("qwen2", {}), ("phi3", {}), ("mistral", {"sliding_window": 3})])
def test_greedy_output_is_exact_on_other_architectures(arch, extra, tmp_path):
    target = tiny_model(arch, seed=0, layers=3, **extra)  # mistral: its window crossed inside the trees
    folder = ExitLayer(target, 2).save(tmp_path, target)
    prompt = torch.tensor([PROMPT])
    out = opttree.generate(target, prompt, drafter="early-exit", early_exit=folder, budget=8, max_new_tokens=24,
                           eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 24)), arch


def test_sampled_tokens_follow_the_target_distribution(tmp_path):
    target = tiny_model("llama", vocab=5, hidden=32, layers=2, seed=11, init=0.6)
    folder = ExitLayer(target, 1).save(tmp_path, target)
    prompt, runs, warp = torch.tensor([[1, 3, 0, 4, 1, 3]]), 1000, {"temperature": 0.8, "top_k": 3}
    counts = sample_counts(target, None, prompt, 2, runs, tree="opt", drafter="early-exit", early_exit=folder,
                           budget=6, max_depth=2, **warp)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 2, **warp), runs) > 1e-3


def test_the_draft_is_the_targets_first_layers_and_its_cache_stays_untouched(setup):
    """Brute force: the drafter's distribution after the root equals lm_head(exit(target's layer-L states of
    the whole sequence)) / its temperature, from one plain forward; drafting a tree leaves the target's
    cache as it was."""
    target, _, folder = setup
    exit_layer = load_early_exit(folder, target)
    exit_layer.temperature = 0.7
    sequence = torch.tensor(PROMPT)
    with torch.no_grad():
        states = target(sequence[None], output_hidden_states=True).hidden_states  # the prefill's, and the truth
        expected = torch.log_softmax(target.lm_head(exit_layer(states[1], torch.arange(6)[None]))[0, -1] / 0.7, -1)
        cache = opttree.step.cache.new_cache()
        target(sequence[None, :-1], **{opttree.step.cache.cache_argument(target): cache}, use_cache=True)
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        drafter = EarlyExitDrafter(exit_layer, target, 96)
        drafter.start(sequence)
        drafter.seed_hidden(tuple(h[0, :-1] for h in states))
        drafter.share_target_cache(cache)
        root = drafter.root(sequence)
        children = drafter.expand(root.topk(3).indices, torch.tensor([-1, -1, -1]))
        drafter.expand(children[0].topk(2).indices, torch.tensor([0, 0]))
    assert torch.allclose(root, expected, atol=1e-4)
    for (keys, values), layer in zip(before, cache.layers):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)


def test_refusals_name_the_problem(setup, tmp_path):
    target, _, folder = setup
    with pytest.raises(ValueError, match="trained for another target"):
        opttree.generate(tiny_model(seed=7, layers=3), torch.tensor([[1, 2, 3]]), drafter="early-exit",
                         early_exit=folder, max_new_tokens=4)
    with pytest.raises(ValueError, match="not a saved exit layer"):
        opttree.generate(target, torch.tensor([[1, 2, 3]]), drafter="early-exit", early_exit=tmp_path, max_new_tokens=4)
    with pytest.raises(ValueError, match="opttree train early-exit"):
        opttree.generate(target, torch.tensor([[1, 2, 3]]), drafter="early-exit", max_new_tokens=4)
    with pytest.raises(ValueError, match=r"the target has 3, so 1 <= layers <= 2"):
        ExitLayer(target, 3)


def test_training_raises_held_out_acceptance(tmp_path):
    """Steps on text a tiny random target writes: the exit agrees with the target's top token more often
    than the untrained copy of the target's next layer did."""
    from opttree.train.early_exit import train_early_exit
    from opttree.train.head import written_text
    from opttree.train.lm import TrainConfig

    target = tiny_model(seed=3, init=0.5, layers=3).requires_grad_(False)
    corpus = np.random.default_rng(0).integers(3, 96, 4000)
    text = written_text(target, corpus, texts=24, eos=2, prompt_len=8, new_tokens=56, batch=8, log=lambda *_: None)
    cfg = TrainConfig(run_dir=tmp_path / "run", seq_len=32, batch_size=8, lr=3e-3, warmup_steps=5, steps=150,
                      eval_every=150, eval_windows=8, bf16=False)
    _, metrics = train_early_exit(target, 1, text, text, cfg, tmp_path / "exit", log=lambda *_: None)
    assert metrics["heldout_top1"] > metrics["heldout_top1_before"] + 0.1, metrics
    assert load_early_exit(tmp_path / "exit", target).temperature == metrics["temperature"] != 1.0
    prompt = torch.tensor([[5, 9, 13]])
    out = opttree.generate(target, prompt, drafter="early-exit", early_exit=tmp_path / "exit", budget=6,
                           max_new_tokens=24, eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(target, prompt, 24))


def test_the_exit_layer_is_loaded_once_per_target_and_folder(setup, monkeypatch, tmp_path):
    """Repeated generations (a server's requests) reuse the loaded part; a changed folder is read again."""
    import opttree.step.drafters.early_exit as early_exit

    target = setup[0]
    loads = []
    original = early_exit.load_early_exit
    monkeypatch.setattr(early_exit, "load_early_exit", lambda *a: loads.append(a) or original(*a))
    folder, other = (ExitLayer(target, layers).save(tmp_path / name, target) for layers, name in ((1, "a"), (2, "b")))
    for path in (folder, folder, other, folder):
        opttree.generate(target, torch.tensor([PROMPT]), drafter="early-exit", early_exit=path, max_new_tokens=4)
    ExitLayer(target, 1).save(other, target)  # retrained: read again
    opttree.generate(target, torch.tensor([PROMPT]), drafter="early-exit", early_exit=other, max_new_tokens=4)
    assert [str(a[0]) for a in loads] == [str(folder), str(other), str(other)]


@pytest.mark.parametrize("temperature,drafts_at", [(0.0, 0.4), (0.8, 1.0)])
def test_the_exit_layer_drafts_at_its_calibrated_temperature_only_when_greedy(tmp_path, temperature, drafts_at):
    """As the head (`drafting_temperature`): calibrated for greedy acceptance, its own distribution when sampling."""
    target = tiny_model(seed=0, layers=3)
    exit_layer = ExitLayer(target, 1)
    exit_layer.temperature = 0.4
    folder = exit_layer.save(tmp_path / "exit", target)
    run = opttree.stream(target, torch.tensor([PROMPT]), tree="opt", drafter="early-exit", early_exit=folder,
                         budget=4, max_new_tokens=4, temperature=temperature, seed=0)
    next(iter(run))
    drafter = run.drafter.first  # the sources' distribution source
    assert isinstance(drafter, EarlyExitDrafter) and drafter.temperature == drafts_at
