"""Speed on the kinds of model opttree drives since 2026-11-25, against plain decoding, interleaved.

1. A sliding-window target: the shipped target's weights in Mistral's architecture with a 64-token
   window (same weight names; a different model, whose output crosses the window), with the shipped
   draft and with the train-free sources, on HumanEval prompts.
2. A hybrid with convolution layers: a tiny random LFM2 (conv + attention; random weights, so only the
   train-free sources can predict it, from its own repetitions). Tiny and untrained: its figures say
   what the chain verification costs, not what a real LFM2 gains.
3. Attention on key indices, verified as chains too: a tiny random BLOOM (ALiBi) and a tiny random
   GPT-Neo (global + local layers, a 64-token window), the same way; and tiny random recurrent models: Mamba
   (its chains' scan continues the cached state), Zamba (Mamba-1 heads and a shared attention block),
   RecurrentGemma (its blocks' state held per sequence, run token by token in a chain) and xLSTM.
4. What chains cost against a tree forward on the same model: the shipped pair, its target verified as
   one tree (as opttree runs it) and, forced, as chains (`chains`).

    python scripts/new_models_speed.py [--prompts 10] [--new-tokens 128] [--models mistral,lfm2,bloom,gpt-neo,mamba,zamba,recurrent-gemma,xlstm,chains]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from transformers import AutoConfig, AutoModelForCausalLM, MistralConfig, MistralForCausalLM

import opttree
from opttree.demo import demo_paths, load_model

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "humaneval.jsonl"


def windowed_target(window: int) -> MistralForCausalLM:
    target_path, _ = demo_paths()
    llama = load_model(target_path)
    config = MistralConfig(**{k: v for k, v in llama.config.to_dict().items() if k in MistralConfig().to_dict()},
                           sliding_window=window)
    model = MistralForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)
    return model


def tiny_lfm2(vocab: int) -> torch.nn.Module:
    config = AutoConfig.for_model("lfm2", vocab_size=vocab, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  layer_types=["conv", "full_attention", "conv", "full_attention"],
                                  max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def tiny_random(model_type: str, vocab: int, **fields) -> torch.nn.Module:
    """A tiny random model of the size of `tiny_lfm2` (256 wide, 4 layers)."""
    config = AutoConfig.for_model(model_type, vocab_size=vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2, **fields)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


TINY_CHAIN_MODELS = {  # --models name -> (model_type, what it is, config fields)
    "bloom": ("bloom", "attention on key indices", dict(hidden_size=256, n_layer=4, n_head=4)),
    "gpt-neo": ("gpt_neo", "attention on key indices",
                dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=512, window_size=64,
                     max_position_embeddings=1024, attention_types=[[["global", "local"], 2]])),
    "mamba": ("mamba", "recurrent state, no attention", dict(hidden_size=256, num_hidden_layers=4, state_size=16)),
    "zamba": ("zamba", "Mamba-1 heads + a shared attention block",
              dict(hidden_size=256, attention_hidden_size=512, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=4, attention_head_dim=128, n_mamba_heads=2, mamba_d_state=16,
                   mamba_dt_rank=16, num_hidden_layers=4,
                   layers_block_type=["hybrid", "linear_attention", "hybrid", "linear_attention"])),
    "recurrent-gemma": ("recurrent_gemma", "RG-LRU blocks + local attention, state on the blocks",
                        dict(hidden_size=256, lru_width=256, intermediate_size=512, num_attention_heads=4,
                             num_key_value_heads=1, head_dim=64, num_hidden_layers=4, attention_window_size=64,
                             block_types=["recurrent", "recurrent", "attention"])),
    "xlstm": ("xlstm", "mLSTM blocks, xLSTM's own cache",
              dict(hidden_size=256, embedding_dim=256, num_hidden_layers=4, num_blocks=4, num_heads=4,
                   qk_dim_factor=1.0, chunk_size=16, autocast_kernel_dtype="float32")),
}


def run(target, ids, new_tokens: int, kwargs: dict):
    """opttree.generate; `as_chains=True`: the target verified as chains although a tree mask drives it."""
    kwargs = dict(kwargs)
    forced = mock.patch("opttree.engine.verified_as_chains", lambda model: True) if kwargs.pop("as_chains", False) \
        else contextlib.nullcontext()
    with forced:
        return opttree.generate(target, ids, max_new_tokens=new_tokens, eos_token_id=[], **kwargs)


def interleaved(name: str, target, methods: dict, prompts: list[torch.Tensor], new_tokens: int) -> None:
    totals = {m: [0.0, 0, 0] for m in methods}  # seconds, tokens, steps
    for kwargs in methods.values():  # warm-up: the exactness probes and first-call costs stay out of the timing
        run(target, prompts[0], 8, kwargs)
    for ids in prompts:
        reference = None
        for method, kwargs in methods.items():
            start = time.perf_counter()
            out = run(target, ids, new_tokens, kwargs)
            seconds = time.perf_counter() - start
            reference = out.sequences if reference is None else reference
            assert torch.equal(out.sequences, reference), (name, method)
            totals[method][0] += seconds
            totals[method][1] += out.stats.new_tokens
            totals[method][2] += out.stats.steps
    base = totals["ar"][1] / totals["ar"][0]
    print(f"\n{name}: {len(prompts)} prompts x {new_tokens} new tokens, every output identical to `ar`")
    print("| method | MAL | tokens/s | speedup |\n|---|---:|---:|---:|")
    for method, (seconds, tokens, steps) in totals.items():
        print(f"| {method} | {tokens / steps:.2f} | {tokens / seconds:.1f} | {tokens / seconds / base:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--models", default="mistral,lfm2,bloom,gpt-neo,mamba,chains", help="which sections to run")
    args = parser.parse_args()
    models = args.models.split(",")
    torch.set_num_threads(2)
    _, draft_path = demo_paths()
    tokenizer = opttree.demo_models(torch.float32)[2]
    texts = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()[: args.prompts]]
    prompts = [tokenizer(text, return_tensors="pt").input_ids for text in texts]

    vocab = tokenizer.vocab_size if len(tokenizer) <= tokenizer.vocab_size else len(tokenizer)
    train_free = {"ar": {"tree": "ar"}, "opt:recycling+lookup": {"budget": 8},
                  "chain:recycling+lookup": {"tree": "chain", "budget": 4}}
    if "mistral" in models:
        target, draft = windowed_target(64), load_model(draft_path)
        interleaved("shipped target as Mistral, 64-token window", target,
                    {"ar": {"tree": "ar"}, "opt (draft LM)": {"draft": draft, "budget": 8},
                     "opt:recycling+lookup": {"budget": 8}}, prompts, args.new_tokens)
    if "lfm2" in models:
        interleaved("tiny random LFM2 (conv + attention), chains", tiny_lfm2(vocab), train_free, prompts, args.new_tokens)
    for name, (model_type, kind, fields) in TINY_CHAIN_MODELS.items():
        if name in models:
            interleaved(f"tiny random {model_type} ({kind}), chains",
                        tiny_random(model_type, vocab, **fields), train_free, prompts, args.new_tokens)
    if "chains" in models:
        target, draft = opttree.demo_models(torch.float32)[:2]
        interleaved("shipped pair: one tree forward against chains", target,
                    {"ar": {"tree": "ar"}, "opt (draft LM), tree": {"draft": draft, "budget": 8},
                     "opt (draft LM), chains": {"draft": draft, "budget": 8, "as_chains": True},
                     "opt:recycling+lookup, tree": {"budget": 8},
                     "opt:recycling+lookup, chains": {"budget": 8, "as_chains": True}}, prompts, args.new_tokens)
    print(f"\n{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {sys.platform}")


if __name__ == "__main__":
    main()
