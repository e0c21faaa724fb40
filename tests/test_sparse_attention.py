"""Indexed sparse attention (DeepSeek-V3.2's DSA, GLM-5, ...): a learned indexer picks each query's top-k
keys among those its mask allows. Under a tree mask a node's allowed keys are its branch's, so the tree
forward picks what plain decoding picks; the indexer's keys are compacted with the layer's own."""

import pytest
import torch
from arch_configs import tiny
from helpers import Oracle, assert_each_generates, hf_greedy, tiny_model

import opttree

PROMPT = torch.tensor([[1, 5, 7, 9, 11, 13, 17, 19, 23, 29]])
TOPK = 4  # keys each query keeps: far fewer than the context, so the selection decides the output
# 32 indexer heads: with 2 or 8, a random tiny indexer often scores several keys exactly alike (a key's
# score is a weighted sum of ReLU'd dot products, 0 when they all are), and a top-k among tied keys
# depends on the row's length: transformers' own forward of the whole sequence then disagrees with
# its own generate on such a model
SPARSE = {"index_topk": TOPK, "index_head_dim": 16, "index_n_heads": 32}


def sparse(model_type: str, topk: int = TOPK):
    return tiny(model_type, "sdpa", **{**SPARSE, "index_topk": topk})


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_targets_are_identical_to_generate(model_type):
    target = sparse(model_type)
    reference = hf_greedy(target, PROMPT, 30, eos_token_id=[])
    # the test would see a tree forward that ignored the selection: with every key kept, the output differs
    assert not torch.equal(hf_greedy(sparse(model_type, topk=4096), PROMPT, 30, eos_token_id=[]), reference)
    vocab = target.get_output_embeddings().weight.shape[0]
    draft = tiny_model("llama", vocab=vocab, hidden=32, layers=1, seed=3)
    assert_each_generates(target, PROMPT, reference, [(Oracle(reference, vocab), {"budget": 8}),
                                                      (Oracle(reference, vocab), {"tree": "eagle2"}),
                                                      (draft, {"budget": 8}), (None, {"budget": 8}), (None, {"tree": "ar"})])


def test_a_batch_of_sparse_attention_rows_keeps_each_rows_indexer_keys():
    target = sparse("deepseek_v32")
    prompts = [PROMPT[0], PROMPT[0, 3:], torch.tensor([2, 4, 6, 8, 10, 12, 14])]
    outs = opttree.generate(target, prompts, max_new_tokens=20, eos_token_id=[], budget=8)
    for prompt, out in zip(prompts, outs):
        assert torch.equal(out.sequences, hf_greedy(target, prompt[None], 20, eos_token_id=[])), prompt.tolist()


def test_a_sparse_attention_draft_drafts_under_tree_masks():
    target = tiny_model("llama", vocab=sparse("deepseek_v32").get_output_embeddings().weight.shape[0], seed=1)
    out = opttree.generate(target, PROMPT, sparse("deepseek_v32"), max_new_tokens=20, eos_token_id=[], budget=8)
    assert torch.equal(out.sequences, hf_greedy(target, PROMPT, 20, eos_token_id=[]))


def test_the_static_path_is_refused_with_its_reason_and_not_chosen_for_the_user():
    target = sparse("deepseek_v32")
    with pytest.raises(ValueError, match="static=True does not combine with indexed sparse attention"):
        opttree.generate(target, PROMPT, max_new_tokens=4, static=True)
    out = opttree.generate(target, PROMPT, max_new_tokens=8, eos_token_id=[])  # the static path left to the engine
    assert torch.equal(out.sequences, hf_greedy(target, PROMPT, 8, eos_token_id=[]))


def test_early_exit_drafts_on_a_sparse_attention_target(tmp_path):
    """The early-exit drafter runs the target's own first layers over the target's cache: with indexed
    layers, their indexer keys too."""
    from opttree.step.drafters.early_exit import ExitLayer

    target = sparse("deepseek_v32")
    folder = ExitLayer(target, 1).save(tmp_path, target)
    for tree in ("opt", "chain"):
        out = opttree.generate(target, PROMPT, tree=tree, drafter="early-exit", early_exit=folder, budget=8,
                               max_new_tokens=20, eos_token_id=[])
        assert torch.equal(out.sequences, hf_greedy(target, PROMPT, 20, eos_token_id=[])), tree
