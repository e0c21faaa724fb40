"""Per-layer-type tree masks: sliding windows and chunked attention on positions, against transformers'
own mask definitions (brute force, branch by branch) and end to end against `target.generate`."""

import pytest
import torch
from arch_configs import tiny
from helpers import chi_square_pvalue, exact_joint, hf_greedy, sample_counts, tiny_model
from transformers import AutoConfig
from transformers.masking_utils import causal_mask_function, chunked_overlay, sliding_window_overlay

import opttree
from opttree.step.attention import CHUNKED, FULL, SLIDING, Window, key_positions, layer_masks, mask_layout
from opttree.step.tree import position_ids, tree_attention_mask

# root, then: a chain of 5 (nodes 0-4), a sibling branch (5 under the root, 6 under 5), a child of node 1 (7)
PARENTS = torch.tensor([-1, 0, 1, 2, 3, -1, 5, 1])
DEPTHS = torch.tensor([1, 2, 3, 4, 5, 1, 2, 3])


def reference_row(overlay, branch_len: int) -> torch.Tensor:
    """transformers' mask of the last token of a plain sequence of `branch_len` tokens: (branch_len,) bool."""
    q = branch_len - 1
    return torch.tensor([causal_mask_function(0, 0, q, k) and bool(overlay(0, 0, q, k)) for k in range(branch_len)])


@pytest.mark.parametrize("window", [Window("sliding", 2), Window("sliding", 4), Window("sliding", 7),
                                    Window("chunked", 3), Window("chunked", 5)])
@pytest.mark.parametrize("prefix_len", [1, 6])
def test_tree_mask_rows_equal_transformers_mask_of_each_branch(window, prefix_len):
    """Every row of the windowed tree mask attends exactly the keys transformers' own mask gives the last
    token of that node's root-to-node sequence (prefix, root, ancestors, node), row indices mapped."""
    overlay = (sliding_window_overlay(window.size) if window.kind == "sliding"
               else chunked_overlay(window.size, torch.zeros(1, dtype=torch.long)))
    allowed = tree_attention_mask(PARENTS, prefix_len)  # (N+1, P+N+1)
    positions = position_ids(DEPTHS, prefix_len)  # (N+1,)
    layout = mask_layout(AutoConfig.for_model("mistral", sliding_window=window.size) if window.kind == "sliding"
                         else _chunked_config(window.size))
    masks = layer_masks(layout, allowed, positions, lambda: key_positions(prefix_len, positions, allowed.shape[1]))
    mask = masks[CHUNKED] if isinstance(masks, dict) else masks
    for row in range(len(PARENTS) + 1):
        branch = [i + 1 for i in _ancestors(row - 1)] + ([row] if row else [])  # tree rows, root (0) excluded
        keys = list(range(prefix_len)) + [prefix_len] + [prefix_len + r for r in branch]  # cache rows of the branch
        expected = torch.zeros(allowed.shape[1], dtype=torch.bool)
        expected[keys] = reference_row(overlay, len(keys))
        assert torch.equal(mask[row], expected), (row, mask[row], expected)


def _ancestors(node: int) -> list[int]:
    """Node indices from the root's child down to `node` (empty for the root, node -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(PARENTS[node])
    return path[::-1][:-1]


def _chunked_config(size: int):
    return AutoConfig.for_model("llama4_text", attention_chunk_size=size, num_hidden_layers=2,
                                layer_types=[CHUNKED, FULL])


def test_mask_layouts_of_common_configs():
    mistral = mask_layout(AutoConfig.for_model("mistral", sliding_window=16))
    assert not mistral.per_type and mistral.windows == {FULL: Window("sliding", 16)}
    gemma3 = mask_layout(AutoConfig.for_model("gemma3_text", sliding_window=16))
    assert gemma3.per_type and gemma3.windows == {SLIDING: Window("sliding", 16), FULL: None}
    assert not mask_layout(AutoConfig.for_model("llama")).windowed
    assert not mask_layout(AutoConfig.for_model("qwen2", sliding_window=16)).windowed  # use_sliding_window=False
    llama4 = mask_layout(_chunked_config(8))
    assert llama4.per_type and llama4.windows == {CHUNKED: Window("chunked", 8), FULL: None}
    # a config without windows gets the tree mask itself back, untouched and without key positions
    plain = torch.ones(2, 3, dtype=torch.bool)
    assert layer_masks(mask_layout(AutoConfig.for_model("llama")), plain, torch.arange(2),
                       lambda: pytest.fail("key positions computed for a model without windows")) is plain


@pytest.mark.parametrize("model_type, attn", [("mistral", "sdpa"), ("gemma3_text", "eager"), ("gemma2", "eager"),
                                              ("qwen2", "sdpa")])
def test_generations_past_small_windows_are_identical(model_type, attn):
    """A window of 3-5 positions, crossed by the prompt, by the generation and inside one tree (chains of
    budget 8 are deeper than the window): every policy, the target as its own draft (windowed draft
    forwards) and a separate draft, dynamic and static caches."""
    extra = {"use_sliding_window": True, "layer_types": [FULL, SLIDING]} if model_type == "qwen2" else {}
    target = tiny(model_type, attn, sliding_window=4, **extra)
    assert mask_layout(target.config.get_text_config()).windowed
    prompt = torch.tensor([[1, 5, 7, 9, 11, 13, 4, 8, 3]])
    reference = hf_greedy(target, prompt, 30, eos_token_id=[])
    draft = tiny_model("llama", vocab=target.get_output_embeddings().weight.shape[0], hidden=32, layers=1, seed=3)
    for tree, budget, own_draft, static in [("opt", 8, True, False), ("chain", 8, True, True), ("opt", 16, False, True),
                                            ("eagle2", 6, False, False), ("ar", 1, False, False)]:
        out = opttree.generate(target, prompt, target if own_draft else draft, tree=tree, budget=budget,
                               max_new_tokens=30, eos_token_id=[], static=static)
        assert torch.equal(out.sequences, reference), (tree, budget, own_draft, static)
    out = opttree.generate(target, prompt, budget=8, max_new_tokens=30, eos_token_id=[])  # train-free sources
    assert torch.equal(out.sequences, reference)


def test_chunked_attention_is_identical():
    target = tiny("llama4_text", "sdpa", attention_chunk_size=4)
    assert mask_layout(target.config.get_text_config()).windowed
    prompt = torch.tensor([[1, 5, 7, 9, 11, 13]])
    reference = hf_greedy(target, prompt, 24, eos_token_id=[])
    for budget, static in [(8, False), (4, True)]:
        out = opttree.generate(target, prompt, target, budget=budget, max_new_tokens=24, eos_token_id=[], static=static)
        assert torch.equal(out.sequences, reference), (budget, static)


def test_a_window_the_model_does_not_apply_is_refused_not_trusted():
    """Moshi's config has a sliding_window its sdpa path never applies (full causal attention): past the
    window, the window probe sees the difference and refuses; within it, the model runs and is exact."""
    moshi = tiny("moshi", "sdpa", sliding_window=12)
    prompt = torch.tensor([[1, 5, 7, 9, 11, 13]])
    with pytest.raises(NotImplementedError, match="exactness check"):
        opttree.generate(moshi, prompt, budget=4, max_new_tokens=20, eos_token_id=[])
    moshi.config.sliding_window = 100  # past the probe's 64 positions: the window probe alone sees it
    with pytest.raises(NotImplementedError, match="windows set to 3 positions"):
        opttree.generate(moshi, prompt, budget=4, max_new_tokens=120, eos_token_id=[])
    moshi.config.sliding_window = 12
    out = opttree.generate(moshi, prompt, budget=4, max_new_tokens=6, eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(moshi, prompt, 6, eos_token_id=[]))


@pytest.mark.parametrize("model_type, window, new_tokens", [("gpt_oss", 128, 270)])
def test_real_window_sizes_past_twice_the_window(model_type, window, new_tokens):
    """gpt-oss's 128-token sliding layers (tiny widths, the real window), generating past 2x the window:
    every policy and the train-free sources identical. The draft is the target with a noisy output layer
    (sliding layers of its own), so trees past the window are accepted in part and rejected in part.
    (Gemma 3's 1024-token local layers: scripts/window_check.py, too slow for CI.)"""
    target = tiny(model_type, "eager", sliding_window=window, max_position_embeddings=1024)
    prompt = torch.tensor([[1, 5, 7, 9, 11, 13, 4, 8]])
    reference = hf_greedy(target, prompt, new_tokens, eos_token_id=[])
    draft = tiny(model_type, "eager", sliding_window=window, max_position_embeddings=1024)  # the same weights
    with torch.no_grad():
        head = draft.get_output_embeddings().weight  # (V, C)
        head.add_(0.5 * head.std() * torch.randn(head.shape, generator=torch.Generator().manual_seed(5)))
    for tree in ("opt", "chain", "eagle2", "dyspec", "sequoia", "static"):
        out = opttree.generate(target, prompt, draft, tree=tree, budget=8, max_new_tokens=new_tokens, eos_token_id=[])
        assert torch.equal(out.sequences, reference), tree
        assert out.stats.mean_accepted_length > 1.3, (tree, out.stats.mean_accepted_length)  # drafts accepted
    out = opttree.generate(target, prompt, budget=16, max_new_tokens=new_tokens, eos_token_id=[])  # recycling+lookup
    assert torch.equal(out.sequences, reference)


def test_sampled_tokens_past_a_window_follow_the_target_distribution():
    """Sampling exact with a sliding window of 3 crossed by the prompt and inside the trees."""
    target = tiny_model("mistral", vocab=5, hidden=32, layers=2, seed=11, init=0.6, sliding_window=3)
    draft = tiny_model("llama", vocab=5, hidden=32, layers=1, seed=4, init=0.6)
    prompt, runs, warp = torch.tensor([[1, 3, 0, 4, 1, 3]]), 800, {"temperature": 0.8}
    counts = sample_counts(target, draft, prompt, 2, runs, tree="opt", budget=6, max_depth=2, **warp)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 2, **warp), runs) > 1e-3
