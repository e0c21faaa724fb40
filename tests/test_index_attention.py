"""Models whose attention reads a key's index in the cache where a tree needs its position (ALiBi: BLOOM,
MPT, Falcon `alibi=True`; GPT-Neo's local layers; positions from the cache length: BART's decoder family)
run as chains (`opttree.step.chains`): as targets identical to `generate`, sampled exactly; as drafts through
`ChainDrafter`, whose log-probabilities are those of plain forwards of each node's path."""

import pytest
import torch
from arch_configs import tiny_any_attention
from helpers import Oracle, assert_each_generates, chi_square_pvalue, exact_joint, hf_greedy, sample_counts, tiny_model
from test_state_models import hybrid

import opttree
from opttree.step.chains import index_attention, probe_chains, verified_as_chains
from opttree.step.drafters import ChainDrafter, ModelDrafter, model_drafter

PROMPT = torch.tensor([[1, 5, 7, 9, 11, 13]])
NEW_TOKENS = 40  # 6 + 40 tokens: past GPT-Neo's window of 16 below
INDEX_MODELS = {  # name -> (model_type, config fields)
    "bloom": ("bloom", {}), "mpt": ("mpt", {}), "falcon-alibi": ("falcon", {"alibi": True}),
    "gpt-neo-window-16": ("gpt_neo", {"window_size": 16}), "bart": ("bart", {}), "blenderbot": ("blenderbot", {}),
}


@pytest.mark.parametrize("name", sorted(INDEX_MODELS))
def test_index_attention_targets_are_identical_to_generate(name):
    model_type, extra = INDEX_MODELS[name]
    target = tiny_any_attention(model_type, **extra)
    assert index_attention(target.config) and verified_as_chains(target) and probe_chains(target) is None
    reference = hf_greedy(target, PROMPT, NEW_TOKENS, eos_token_id=[])
    vocab = target.get_output_embeddings().weight.shape[0]
    draft = tiny_model("llama", vocab=vocab, hidden=32, layers=1, seed=3)
    assert_each_generates(target, PROMPT, reference, [
        (Oracle(reference, vocab), {"budget": 8}), (Oracle(reference, vocab), {"tree": "chain"}), (draft, {"budget": 16}),
        (draft, {"tree": "dyspec", "budget": 8}), (target, {"budget": 4}), (None, {"budget": 16}), (None, {"tree": "ar"})])


def test_alibi_sampling_follows_the_target_distribution():
    target = tiny_any_attention("bloom", vocab_size=6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                initializer_range=0.6)
    draft = tiny_model("llama", vocab=6, hidden=32, layers=1, seed=4, init=0.6)
    prompt, runs, warp = torch.tensor([[1, 3, 0, 4, 1, 3]]), 600, {"temperature": 0.9}
    counts = sample_counts(target, draft, prompt, 2, runs, tree="opt", budget=6, max_depth=2, **warp)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 2, **warp), runs) > 1e-3


def test_sampling_with_a_chain_drafted_draft_follows_the_target_distribution():
    """A BLOOM draft (`ChainDrafter`) with sampled children: the draws carry the distributions the chains gave."""
    target = tiny_model("llama", vocab=6, hidden=32, layers=1, seed=4, init=0.6)
    draft = tiny_any_attention("bloom", vocab_size=6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               initializer_range=0.6)
    prompt, runs, warp = torch.tensor([[1, 3, 0, 4, 1, 3]]), 600, {"temperature": 0.9}
    counts = sample_counts(target, draft, prompt, 2, runs, tree="opt", budget=6, max_depth=2, **warp)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 2, **warp), runs) > 1e-3


# Expansions in the order a heap-driven policy (DySpec) may make them: parents at any earlier depth.
EXPANSIONS = [([3, 4, 5], [-1, -1, -1]), ([6, 7], [0, 0]), ([8], [1]), ([9, 10], [3, 3]), ([11], [5]), ([12], [7])]


@pytest.mark.parametrize("model", ["bloom", "gpt_neo", "bart", "lfm2", "qwen3_next", "llama"])
def test_chain_drafter_gives_each_node_the_log_probs_of_its_path(model):
    """Each expanded node's log-probabilities equal a plain forward of prefix + root + its path, and the
    cache holds the committed tokens only, step after step (the second root follows an accepted branch)."""
    draft = hybrid(model) if model in ("lfm2", "qwen3_next") else tiny_any_attention(model, window_size=4) \
        if model == "gpt_neo" else tiny_any_attention(model)
    assert isinstance(model_drafter(draft), ChainDrafter if model != "llama" else ModelDrafter)
    drafter = ChainDrafter(draft)
    committed = PROMPT[0]
    with torch.inference_mode():
        drafter.start(committed)
        for step in range(2):
            root = drafter.root(committed)
            expected = torch.log_softmax(draft(input_ids=committed[None]).logits[0, -1].float(), -1)
            torch.testing.assert_close(root, expected, atol=1e-4, rtol=1e-4)
            tokens, parents = [], []
            for new, parent_slots in EXPANSIONS:
                log_probs = drafter.expand(torch.tensor(new), torch.tensor(parent_slots))
                tokens, parents = tokens + new, parents + parent_slots
                for k, slot in enumerate(range(len(tokens) - len(new), len(tokens))):
                    path = []
                    while slot >= 0:
                        path, slot = [tokens[slot]] + path, parents[slot]
                    full = draft(input_ids=torch.cat([committed, torch.tensor(path)])[None]).logits[0, -1]
                    torch.testing.assert_close(log_probs[k], torch.log_softmax(full.float(), -1), atol=1e-4, rtol=1e-4)
            committed = torch.cat([committed, torch.tensor([tokens[1], tokens[8], 20])])  # an accepted branch + bonus


def test_what_index_attention_targets_do_not_combine_with():
    target = tiny_any_attention("bloom")
    with pytest.raises(ValueError, match="static=True does not combine with a target verified as chains"):
        opttree.generate(target, PROMPT, max_new_tokens=8, static=True)
    with pytest.raises(NotImplementedError, match="verified as chains"):
        opttree.generate(target, [PROMPT[0], PROMPT[0, :4]], max_new_tokens=8)
