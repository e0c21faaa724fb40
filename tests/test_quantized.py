"""Quantized models (torchao and bitsandbytes, CPU): opttree's output equals the quantized model's own greedy
generate, whether quantized in memory (`opttree.quantize`, `--quantize`) or loaded quantized with
`from_pretrained`; what quantizes activations at run time is refused by name."""

import json

import pytest
import torch
from helpers import hf_greedy, tiny_model

import opttree
from opttree.quantize import SCHEMES, quantize

torchao = pytest.importorskip("torchao")
PROMPT = torch.tensor([[1, 5, 7, 9, 11, 13]])


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_quantized_target_and_draft_are_exact_against_their_own_generate(scheme):
    target = quantize(tiny_model("llama", seed=0), scheme)
    draft = quantize(tiny_model("llama", seed=1, hidden=32, layers=1), scheme)
    assert type(target.model.layers[0].mlp.up_proj.weight) is not torch.nn.Parameter  # really quantized
    reference = hf_greedy(target, PROMPT, 40, eos_token_id=[])
    assert not torch.equal(reference, hf_greedy(tiny_model("llama", seed=0), PROMPT, 40, eos_token_id=[])) \
        or scheme == "int8"  # a different model (int8 weights may keep every argmax of this tiny one)
    for draft_model, options in [(draft, {"budget": 16}), (draft, {"budget": 8, "static": True}),
                                 (None, {"budget": 8}), (None, {"tree": "ar"})]:
        out = opttree.generate(target, PROMPT, draft_model, max_new_tokens=40, eos_token_id=[], **options)
        assert torch.equal(out.sequences, reference), (scheme, options)


def test_a_model_saved_quantized_loads_and_is_exact(tmp_path):
    from transformers import AutoModelForCausalLM, TorchAoConfig

    tiny_model("llama", seed=0).save_pretrained(tmp_path)
    config = TorchAoConfig(torchao.quantization.Int8WeightOnlyConfig())
    target = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config).eval()
    assert target.config.quantization_config is not None
    out = opttree.generate(target, PROMPT, budget=8, max_new_tokens=30, eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(target, PROMPT, 30, eos_token_id=[]))


def test_activation_quantization_is_refused_by_name():
    """int8 dynamic activations: the tree forward and a causal forward differ by whole quantization steps."""
    target = tiny_model("llama", seed=1)
    torchao.quantization.quantize_(target, torchao.quantization.Int8DynamicActivationInt8WeightConfig())
    with pytest.raises(NotImplementedError, match="activations are quantized at run time"):
        opttree.generate(target, PROMPT, budget=8, max_new_tokens=8)


def test_unknown_scheme_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown quantization 'int2'.*int8"):
        quantize(tiny_model("llama"), "int2")


def test_cli_quantize_flag_gives_the_quantized_models_greedy_output(tmp_path, capsys):
    from helpers import char_tokenizer

    from opttree.cli import main

    tok = char_tokenizer()
    for name, kw in {"target": dict(seed=1), "draft": dict(seed=2, layers=1, hidden=32)}.items():
        tiny_model("llama", **kw).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    rc = main(["generate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompt", "abcdef",
               "--dtype", "float32", "--quantize", "int4", "--draft-quantize", "int8", "--max-new-tokens", "20",
               "--budget", "8", "--json"])
    assert rc == 0
    ids = tok("abcdef", return_tensors="pt").input_ids
    reference = hf_greedy(quantize(tiny_model("llama", seed=1), "int4"), ids, 20, eos_token_id=tok.eos_token_id)
    assert json.loads(capsys.readouterr().out)["token_ids"] == reference[0, ids.shape[1]:].tolist()


def test_a_model_quantized_in_memory_has_a_calibration_profile_of_its_own():
    from opttree.profiles import profile_key

    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1, hidden=32, layers=1)
    plain = profile_key(target, draft)
    assert profile_key(quantize(target, "int8"), draft) != plain


def test_a_quantized_target_keeps_the_fingerprint_its_trained_parts_check():
    """Parts (heads, exit layers) trained for a target recognise it quantized: its LM head is read dequantized."""
    from opttree.parts import same_target, target_fingerprint

    plain = target_fingerprint(tiny_model("llama", seed=0))
    assert same_target(plain, target_fingerprint(quantize(tiny_model("llama", seed=0), "int8")))


def test_int4_groups_fit_the_layers_input_sizes():
    """The shipped target has layers of 688 inputs (not a multiple of 32): groups of 16 are used."""
    target = quantize(tiny_model("llama", seed=0, hidden=48), "int4")  # MLP inputs of 96, attention of 48
    out = opttree.generate(target, PROMPT, budget=8, max_new_tokens=20, eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(target, PROMPT, 20, eos_token_id=[]))
    with pytest.raises(ValueError, match="input sizes"):
        quantize(tiny_model("llama", seed=0, hidden=36), "int4")


def _bitsandbytes_model(path, seed: int, **quantization):
    """A tiny Llama saved in fp32 and loaded quantized by bitsandbytes on the CPU (its widths multiples of 64:
    bitsandbytes' CPU 4-bit path quantizes blocks of 64 inputs)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    pytest.importorskip("bitsandbytes")
    tiny_model("llama", seed=seed, hidden=64, vocab=128).save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(**quantization),
                                                device_map="cpu").eval()


@pytest.mark.parametrize("quantization", [dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
                                          dict(load_in_4bit=True, bnb_4bit_quant_type="fp4",
                                               bnb_4bit_compute_dtype=torch.bfloat16)])
def test_a_bitsandbytes_4bit_target_and_draft_are_exact_against_their_own_generate(tmp_path, quantization):
    target = _bitsandbytes_model(tmp_path / "target", 0, **quantization)
    draft = _bitsandbytes_model(tmp_path / "draft", 1, **quantization)
    assert type(target.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"  # really quantized
    reference = hf_greedy(target, PROMPT, 40, eos_token_id=[])
    assert not torch.equal(reference, hf_greedy(tiny_model("llama", seed=0, hidden=64, vocab=128), PROMPT, 40,
                                                eos_token_id=[]))  # a model of its own
    for draft_model, options in [(draft, {"budget": 16}), (None, {"budget": 8}), (None, {"tree": "chain"})]:
        out = opttree.generate(target, PROMPT, draft_model, max_new_tokens=40, eos_token_id=[], **options)
        assert torch.equal(out.sequences, reference), (quantization, options)


def test_bitsandbytes_8bit_is_refused_by_name(tmp_path):
    """LLM.int8 rounds activations to int8 and picks outlier columns from all the tokens of a forward: on this
    model a tree forward's logits differ from a causal forward's by ~0.1."""
    target = _bitsandbytes_model(tmp_path, 1, load_in_8bit=True)
    with pytest.raises(NotImplementedError, match="bitsandbytes 8-bit.*load_in_4bit"):
        opttree.generate(target, PROMPT, budget=8, max_new_tokens=8)
