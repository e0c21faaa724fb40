"""Models with recurrent or convolution state layers, verified as a batch of chains (`opttree.step.chains`):
hybrids, pure recurrent models (Mamba-1, RWKV, RecurrentGemma) and DeepSeek-V4's compressed attention
identical to `generate`, and sampled exactly; a Mamba-1 chain's scan continues the cached state, and
RecurrentGemma's blocks continue theirs token by token."""

import contextlib
from copy import deepcopy
from unittest import mock

import pytest
import torch
from arch_configs import tiny
from helpers import Oracle, assert_each_generates, chi_square_pvalue, exact_joint, hf_greedy, sample_counts, tiny_model

import opttree
from opttree.step import own_state
from opttree.step.chains import forward_chains, has_state, probe_chains, state_cache

PROMPT = torch.tensor([[1, 5, 7, 9, 11, 13]])
HYBRIDS = {"lfm2": ["conv", "full_attention"],  # short convolution + attention (LFM2)
           "granitemoehybrid": ["mamba", "attention"],  # Mamba-2 + attention (Granite 4)
           "qwen3_next": ["linear_attention", "full_attention"],  # gated DeltaNet + attention (Qwen3-Next)
           # Mamba-2 + attention + MoE and MLP layers of their own (Nemotron-H, Nemotron 3 Nano)
           "nemotron_h": ["linear_attention", "moe", "full_attention", "mlp"],
           # attention whose keys and values pass short convolutions (a state), full and sliding (Inkling)
           "inkling_text": ["hybrid", "hybrid_sliding"],
           # compressed attention over a sliding window: pooled every 8 and every 4 tokens (DeepSeek-V4)
           "deepseek_v4": ["heavily_compressed_attention", "compressed_sparse_attention"]}
# sizes the generic tiny config leaves large (Nemotron-H's Mamba heads and shared expert)
SIZED = {"nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=8,
                            moe_shared_expert_intermediate_size=32),
         # 6 + 30 tokens cross the window and several pooled entries of each kind
         "deepseek_v4": dict(sliding_window=16, compress_rates={"compressed_sparse_attention": 4,
                                                                "heavily_compressed_attention": 8})}


# Models whose layer pattern or state is set by fields of their own (no `layer_types`; the sweep's generic tiny
# config breaks them): small configs that their own generate runs on a CPU (the torch fallbacks of the Mamba kernels)
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
OWN_CONFIG = {
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                  mamba_dt_rank=8),  # Mamba + attention, mixture of experts (Jamba)
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=8,
                  mamba_chunk_size=16),  # Mamba-2 + attention (Bamba)
    "falcon_h1": dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_ssm=128, mamba_n_groups=1, mamba_d_state=8,
                      mamba_chunk_size=16, head_dim=16),  # Mamba-2 and attention side by side in each layer
    "zamba2": dict(mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, chunk_size=16, num_key_value_heads=4,
                   layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1], use_mem_rope=False),  # shared attention
    # Mamba-1 with a scan per head, and one attention block shared by its hybrid layers (two: the sharing is
    # declared as tied weights, which needs a second); init 0.3: at 0.02 its greedy output repeats one token
    "zamba": dict(attention_hidden_size=128, attention_head_dim=32, num_key_value_heads=4, n_mamba_heads=2,
                  mamba_d_state=8, mamba_dt_rank=8, num_hidden_layers=3, initializer_range=0.3,
                  layers_block_type=["hybrid", "linear_attention", "hybrid"]),
    # RG-LRU recurrent blocks (their state kept on the blocks: `opttree.step.own_state`) around local attention over
    # 16 positions; untied embeddings at init 0.5: tied ones, or smaller, give a greedy output of one token
    "recurrent_gemma": dict(lru_width=64, head_dim=16, attention_window_size=16, num_hidden_layers=3,
                            block_types=["recurrent", "attention", "recurrent"], initializer_range=0.5,
                            tie_word_embeddings=False),
    # mLSTM blocks only, their state in xLSTM's own cache (`opttree.step.own_state`); qk_dim_factor 1: at its default
    # of 0.5, transformers' xLSTMCache is made with the wrong key width and its own generate fails
    "xlstm": dict(embedding_dim=64, num_blocks=2, num_heads=4, qk_dim_factor=1.0, chunk_size=8,
                  autocast_kernel_dtype="float32"),
}


def hybrid(model_type: str, **extra):
    if model_type in OWN_CONFIG:
        from transformers import CONFIG_MAPPING, AutoModelForCausalLM

        torch.manual_seed(0)
        config = CONFIG_MAPPING[model_type](**{**SMALL, **OWN_CONFIG[model_type], **extra})
        return AutoModelForCausalLM.from_config(config, attn_implementation=None if model_type == "xlstm" else "sdpa"
                                                ).eval()  # xLSTM has no attention: its own default
    if model_type == "granitemoehybrid":
        extra.setdefault("mamba_chunk_size", 8)  # transformers' torch chunk scan pads every forward to a chunk
    extra = {**SIZED.get(model_type, {}), **extra}
    try:
        return tiny(model_type, "sdpa", layer_types=HYBRIDS[model_type], **extra)
    except ValueError:
        return tiny(model_type, "eager", layer_types=HYBRIDS[model_type], **extra)


MAMBA1 = ["mamba", "falcon_mamba"]  # pure Mamba-1 models: the scan from the cached state (`opttree.step.scan`)
OWN_STATE = ["rwkv", "minimax"]  # a state outside transformers' cache layers (`opttree.step.own_state`)


@pytest.mark.parametrize("model_type", sorted(HYBRIDS) + sorted(OWN_CONFIG) + MAMBA1 + OWN_STATE)
def test_state_models_are_identical_to_generate(model_type):
    hybrid_model = model_type in HYBRIDS or model_type in OWN_CONFIG
    target = hybrid(model_type) if hybrid_model else tiny(model_type, "eager")
    assert has_state(target) and probe_chains(target) is None
    reference = hf_greedy(target, PROMPT, 30, eos_token_id=[])
    vocab = target.get_output_embeddings().weight.shape[0]
    draft = tiny_model("llama", vocab=vocab, hidden=32, layers=1, seed=3)
    own_draft = [] if hybrid_model else [(target, {"budget": 6})]  # the model as its own draft (`ChainDrafter`)
    assert_each_generates(target, PROMPT, reference, [(Oracle(reference, vocab), {"budget": 8}),
                                                      (Oracle(reference, vocab), {"tree": "chain"}),
                                                      (draft, {"budget": 8}), *own_draft,
                                                      (None, {"budget": 8}), (None, {"tree": "ar"})])


@pytest.mark.parametrize("model_type", ["lfm2", "mamba"])  # a hybrid with convolution state; a pure recurrent model
def test_sampled_tokens_follow_the_target_distribution(model_type):
    small = dict(vocab_size=6, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.6)
    target = hybrid(model_type, **small) if model_type in HYBRIDS else tiny(model_type, "eager", **small)
    draft = tiny_model("llama", vocab=6, hidden=32, layers=1, seed=4, init=0.6)
    prompt, runs, warp = torch.tensor([[1, 3, 0, 4, 1, 3]]), 600, {"temperature": 0.9}
    counts = sample_counts(target, draft, prompt, 2, runs, tree="opt", budget=6, max_depth=2, **warp)
    assert chi_square_pvalue(counts, exact_joint(target, prompt, 2, **warp), runs) > 1e-3


@pytest.mark.parametrize("model_type", MAMBA1 + ["jamba", "zamba"])
def test_a_chain_continues_the_cached_mamba1_state(model_type):
    """transformers' Mamba-1 mixers restart the scan from zero on a forward of several tokens; through
    `forward_chains` the scan continues the cached state (on Jamba's tiny random layer the restart moves the
    logits by only ~2e-4, which a tolerance-based probe let through; Zamba runs one scan per head)."""
    model = hybrid(model_type) if model_type in OWN_CONFIG else tiny(model_type, "eager")
    tokens = torch.randint(3, 90, (1, 14), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = model(input_ids=tokens).logits[0, 6:]  # (8, V)

        def continued() -> float:
            cache = state_cache(model)
            forward_chains(model, cache, tokens[:, :6], 0)
            return float((forward_chains(model, cache, tokens[:, 6:], 6)[0] - full).abs().max())

        # float32 rounding, relative to the logits' scale: Zamba's scan per head differs from the full forward's
        # by up to ~1e-5 of it on a 2-core AMD EPYC; a restart moves Jamba's by 1.2e-4 of it, Zamba's by ~1
        tolerance = 2e-5 * float(full.abs().max())
        assert continued() < tolerance
        with mock.patch("opttree.step.chains.continued_scans", lambda model: contextlib.nullcontext()):
            assert continued() > tolerance  # transformers' own forward: restarted from zero


def test_recurrent_gemma_blocks_continue_their_state_token_by_token():
    """RecurrentGemma's recurrent blocks restart their convolution from zeros on a forward of several tokens;
    `opttree.step.own_state` runs such a forward token by token once a state is cached (else the chains differ)."""
    assert probe_chains(hybrid("recurrent_gemma")) is None
    block = own_state._block_class()
    with mock.patch.object(block, "forward", block.forward.__wrapped__):  # transformers' own forward
        assert "several new tokens" in probe_chains(hybrid("recurrent_gemma"))
    bound = hybrid("recurrent_gemma")
    opttree.generate(bound, PROMPT, budget=6, max_new_tokens=4, eos_token_id=[])  # its hooks set
    copy = deepcopy(bound)  # a copy keeps its hooks, and is not bound twice
    reference = hf_greedy(copy, PROMPT, 12, eos_token_id=[])
    assert torch.equal(opttree.generate(copy, PROMPT, budget=6, max_new_tokens=12, eos_token_id=[]).sequences, reference)


def test_what_state_models_do_not_combine_with(tmp_path):
    target = hybrid("lfm2")
    with pytest.raises(ValueError, match="static=True does not combine"):
        opttree.generate(target, PROMPT, max_new_tokens=8, static=True)
    from opttree.step.drafters.head import FeatureHead, head_config

    folder = FeatureHead(head_config(target)).save(tmp_path, target)
    with pytest.raises(ValueError, match="hidden states"):  # the feature head reads the target's hidden states
        opttree.generate(target, PROMPT, drafter="head", head=folder, max_new_tokens=8)
    state_draft = hybrid("lfm2")  # a draft's state cannot follow a tree: it drafts chains (`ChainDrafter`)
    llama = tiny_model("llama", vocab=state_draft.get_output_embeddings().weight.shape[0])
    out = opttree.generate(llama, PROMPT, state_draft, max_new_tokens=8, eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(llama, PROMPT, 8, eos_token_id=[]))
