"""Packed linear weights (`opttree.packed`): a bf16 layer runs packed only at row counts where the packed kernel
matched the plain one bit for bit, a float32 one from 2 rows where it agreed within float32 rounding (1 row: the plain
kernel), and a generation's tokens do not change."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_model

import opttree
from opttree import packed as packing
from opttree.packed import PackedLinears, entered, packed_linears, packing_applies
from opttree.step.lean import shared_inputs

BF16_KERNELS = torch.backends.mkldnn.is_available() and packing._LINEAR is not None and \
    torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_a_layer_runs_packed_only_up_to_the_rows_where_the_kernels_agreed(monkeypatch):
    """A stand-in packed kernel that is off from 5 rows on: checked rows 1..4, run packed there only."""
    calls = []

    def kernel(x, weight, bias, *args):
        calls.append(x.shape[0])
        out = F.linear(x, weight, bias)
        return out + 1 if x.shape[0] >= 5 else out

    monkeypatch.setattr(packing, "_LINEAR", kernel)
    layer = torch.nn.Linear(8, 3).to(torch.bfloat16)
    assert packing._checked_rows([layer], layer.weight.detach()) == 4
    rows = packing._rows_run(torch.bfloat16, 4)
    with torch.inference_mode():
        x = torch.randn(2, 2, 8, dtype=torch.bfloat16)  # 4 rows: packed
        calls.clear()
        assert torch.equal(packing._packed_forward(layer, layer.weight, rows, x), F.linear(x, layer.weight, layer.bias))
        assert calls == [4]
        calls.clear()
        wide = torch.randn(6, 8, dtype=torch.bfloat16)  # past the limit: the plain layer
        assert torch.equal(packing._packed_forward(layer, layer.weight, rows, wide),
                           F.linear(wide, layer.weight, layer.bias))
        assert calls == []
    x = torch.randn(3, 8, dtype=torch.bfloat16)  # grad mode (training): the plain layer
    packing._packed_forward(layer, layer.weight, rows, x)
    assert calls == []


def test_a_float32_layer_runs_packed_from_two_rows_where_the_kernels_agree(monkeypatch):
    """float32: checked from 2 rows within float32 rounding (a kernel off by more is caught), never run packed on
    1 row (plain decoding keeps the plain kernel, bit for bit)."""
    calls = []

    def kernel(x, weight, bias, *args):
        calls.append(x.shape[0])
        out = F.linear(x, weight, bias)
        return out * (1 + 1e-6) if x.shape[0] < 7 else out * 1.01  # rounding-sized from 2 rows; off from 7

    monkeypatch.setattr(packing, "_LINEAR", kernel)
    layer = torch.nn.Linear(8, 3)
    assert packing._checked_rows([layer], layer.weight.detach()) == 5 and min(calls) == 2  # 5 passed, 8 did not
    rows = packing._rows_run(torch.float32, 5)
    assert list(rows) == [2, 3, 4, 5]
    with torch.inference_mode():
        calls.clear()
        one = torch.randn(1, 8)
        assert torch.equal(packing._packed_forward(layer, layer.weight, rows, one), F.linear(one, layer.weight,
                                                                                              layer.bias))
        assert calls == []  # one row: the plain kernel
        packing._packed_forward(layer, layer.weight, rows, torch.randn(5, 8))
        assert calls == [5]


ONEDNN = torch.backends.mkldnn.is_available() and packing._LINEAR is not None


def test_packing_applies_to_bf16_and_float32_cpu_models_that_fit_in_memory(monkeypatch):
    assert not packing_applies(tiny_model("llama"))  # float32 weights too small to pay for the packed kernel
    assert packing_applies(tiny_model("llama", hidden=384)) == ONEDNN  # float32 weights of 384 x 384 and more
    model = tiny_model("llama").to(torch.bfloat16)
    if BF16_KERNELS:
        assert packing_applies(model)
    monkeypatch.setattr(packing, "available_bytes", lambda: 1000)  # the copies would not fit
    assert not packing_applies(model)
    monkeypatch.undo()
    compiled = opttree.compile_model(tiny_model("llama").to(torch.bfloat16))  # its step compiles when first called
    assert not packing_applies(compiled)  # inductor makes its own kernels


@pytest.mark.skipif(not BF16_KERNELS, reason="no oneDNN bf16 matrix kernels on this CPU")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox", "phi3"])  # biases, fused projections
def test_generation_is_token_identical_with_packed_weights(monkeypatch, arch):
    target, draft = tiny_model(arch, seed=0).to(torch.bfloat16), tiny_model(arch, seed=1).to(torch.bfloat16)
    prompt = torch.tensor([[1, 5, 9, 13, 2, 7]])
    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("OPTTREE_PACKED", setting)
        runs[setting] = [opttree.generate(target, prompt, draft, max_new_tokens=24, budget=budget).sequences
                         for budget in (1, 8, 40)]
    assert all(torch.equal(a, b) for a, b in zip(runs["0"], runs["1"]))
    pack = packed_linears(target)
    assert pack is not None and len(pack.layers) == sum(type(m) is torch.nn.Linear for m in target.modules())
    if arch in ("llama", "qwen2"):  # each layer's q, k, v and gate, up packed together too (`lean.shared_inputs`)
        grouped = [layer for group in pack.groups.values() for layer in group.layers]
        assert len(pack.groups) == 2 * target.config.num_hidden_layers and len(grouped) == 5 * len(pack.groups) // 2
    assert all(len(rows) >= 1 for _, _, rows in pack.layers)  # each runs packed at some row counts
    layer = pack.layers[0][0]
    with entered([pack]):
        with entered([pack]):  # two generations stepping at once: the last out restores
            assert "forward" in layer.__dict__
        assert "forward" in layer.__dict__
    assert "forward" not in layer.__dict__  # the model is as it was outside the steps
    with torch.no_grad():
        layer.weight.mul_(1.0)  # changed in place: packed again on next use
    assert pack.stale() and packed_linears(target) is not pack


@pytest.mark.skipif(not BF16_KERNELS, reason="no oneDNN bf16 matrix kernels on this CPU")
def test_packed_layers_match_the_plain_ones_bit_for_bit():
    model = tiny_model("llama", hidden=96).to(torch.bfloat16)
    pack = PackedLinears(model)
    ids = torch.randint(0, 90, (1, 30))
    with torch.inference_mode():
        plain = model(ids).logits
        with entered([pack]):
            packed = model(ids).logits
    assert torch.equal(plain, packed)


@pytest.mark.skipif(not BF16_KERNELS, reason="no oneDNN bf16 matrix kernels on this CPU")
def test_the_checked_limits_are_kept_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path))
    checked = []
    monkeypatch.setattr(packing, "_checked_rows", lambda layers, packed: checked.append(layers[0].weight.shape) or 7)
    model = tiny_model("llama").to(torch.bfloat16)
    first = PackedLinears(model)
    shapes = {(m.in_features, m.out_features) for m in model.modules() if type(m) is torch.nn.Linear}
    shapes |= {tuple((m.in_features, m.out_features) for m in group) for group in shared_inputs(model)}  # stacked
    assert len(checked) == len(shapes) and {rows for _, _, rows in first.layers} == {range(1, 8)}
    assert {group.rows for group in first.groups.values()} == {range(1, 8)}
    again = PackedLinears(tiny_model("llama", seed=3).to(torch.bfloat16))  # other weights, the same shapes
    assert len(checked) == len(shapes) and {rows for _, _, rows in again.layers} == {range(1, 8)}  # read, not checked


def test_a_cpu_whose_kernels_refuse_to_pack_runs_the_plain_layers(monkeypatch):
    """oneDNN raises where its bf16 kernels are not built for the CPU (seen with ONEDNN_MAX_CPU_ISA=AVX2 on an
    AVX512 machine, where the CPU check still says yes): the generation runs unpacked."""
    def refuse(model):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(packing, "packing_applies", lambda model: True)
    monkeypatch.setattr(packing, "PackedLinears", refuse)
    target = tiny_model("llama").to(torch.bfloat16)
    assert packed_linears(target) is None
    out = opttree.generate(target, torch.tensor([[1, 5, 9]]), max_new_tokens=8, tree="ar", eos_token_id=[])
    assert out.sequences.shape[1] == 11


@pytest.mark.skipif(not BF16_KERNELS, reason="no oneDNN bf16 matrix kernels on this CPU")
def test_the_networks_a_drafter_runs_are_packed_too(monkeypatch):
    """The draft model, the feature head (and its draft-vocabulary LM head rows): each declares its networks,
    the generation packs them with the target, and the tokens stay those of the plain layers."""
    target, draft, tokenizer = opttree.demo_models(torch.bfloat16)
    ids = tokenizer("def add(a, b):\n", return_tensors="pt").input_ids
    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("OPTTREE_PACKED", setting)
        for drafter, given in (("model", draft), ("head", None)):
            run = opttree.stream(target, ids, given, drafter=drafter, budget=8, max_new_tokens=24, eos_token_id=[])
            runs[(setting, drafter)] = (run.finish().sequences, len(run.packed))
    for drafter in ("model", "head"):
        assert torch.equal(runs[("0", drafter)][0], runs[("1", drafter)][0])
        assert runs[("0", drafter)][1] == 0
    assert runs[("1", "model")][1] == 2  # the target and the draft model
    assert runs[("1", "head")][1] >= 2  # the target and the head (and its kept LM head rows, where it has them)


@pytest.mark.skipif(not BF16_KERNELS, reason="no oneDNN bf16 matrix kernels on this CPU")
def test_a_model_converted_after_use_is_packed_as_it_is_now():
    model = tiny_model("llama", hidden=384)
    as_float32 = packed_linears(model)  # float32 packs too
    assert as_float32 is not None and {layer.weight.dtype for layer, _, _ in as_float32.layers} == {torch.float32}
    model.to(torch.bfloat16)
    pack = packed_linears(model)
    assert pack is not None and pack is not as_float32 and packed_linears(model) is pack  # packed again, then kept
    assert {layer.weight.dtype for layer, _, _ in pack.layers} == {torch.bfloat16}
    model.to(torch.float32)
    again = packed_linears(model)  # its weights were replaced: packed again, as they are now
    assert again is not pack and {layer.weight.dtype for layer, _, _ in again.layers} == {torch.float32}


@pytest.mark.skipif(not BF16_KERNELS, reason="no oneDNN bf16 matrix kernels on this CPU")
def test_an_unreadable_limits_file_is_checked_again(monkeypatch, tmp_path):
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path))
    path = packing._limits_path()
    path.parent.mkdir(parents=True)
    path.write_text('{"64x64": 1')  # cut short
    pack = PackedLinears(tiny_model("llama").to(torch.bfloat16))
    assert pack.layers and json.loads(path.read_text())  # checked, and written whole


@pytest.mark.skipif(not BF16_KERNELS, reason="no oneDNN bf16 matrix kernels on this CPU")
def test_q_k_v_and_gate_up_run_as_one_product_each_with_the_plain_layers_logits(monkeypatch):
    """Under the lean forward, a layer's q, k, v take one product and its gate, up another (checked bit for bit
    against the plain layers, as single layers are): 4 products a layer instead of 7, the same logits."""
    from opttree.step.cache import new_cache
    from opttree.step.lean import lean_forward

    model = tiny_model("llama", seed=2, layers=2).to(torch.bfloat16)
    pack = packed_linears(model)  # the model's own (what the lean forward finds while it is entered)
    products = []
    kernel = packing._LINEAR
    monkeypatch.setattr(packing, "_LINEAR", lambda x, *args: products.append(x.shape[0]) or kernel(x, *args))
    ids, positions = torch.randint(0, 90, (1, 9)), torch.arange(9)[None]
    with torch.inference_mode():
        plain = model(input_ids=ids, position_ids=positions, cache=new_cache()).logits
        with entered([pack]):
            lean = lean_forward(model, None)(input_ids=ids, position_ids=positions, cache=new_cache()).logits
    assert torch.equal(plain, lean)
    assert len(products) == 2 * 4 + 1  # per layer: q|k|v, o, gate|up, down; and the head


@pytest.mark.skipif(not BF16_KERNELS, reason="no oneDNN bf16 matrix kernels on this CPU")
def test_a_model_packed_before_its_groups_were_declared_is_packed_again(monkeypatch):
    monkeypatch.setattr(packing, "_SHARED_INPUTS", [])  # as if no forward had declared any yet
    model = tiny_model("llama").to(torch.bfloat16)
    first = packed_linears(model)
    assert first is not None and not first.groups and packed_linears(model) is first
    packing.register_shared_inputs(shared_inputs)
    again = packed_linears(model)
    assert again is not first and len(again.groups) == 2 * model.config.num_hidden_layers


@pytest.mark.skipif(not BF16_KERNELS, reason="no oneDNN bf16 matrix kernels on this CPU")
def test_the_groups_come_after_the_layers_own_copies_in_memory(monkeypatch):
    """Every layer keeps its own packed copy (a forward the lean one does not drive runs them); the stacked copies
    are made only where both fit in the memory share, and a hooked layer runs on its own."""
    model = tiny_model("llama").to(torch.bfloat16)
    size = sum(m.weight.numel() * 2 for m in model.modules() if type(m) is torch.nn.Linear)
    monkeypatch.setattr(packing, "available_bytes", lambda: int(1.2 * size / packing.MEMORY_SHARE))
    tight = PackedLinears(model)
    assert len(tight.layers) == sum(type(m) is torch.nn.Linear for m in model.modules()) and not tight.groups
    monkeypatch.undo()
    pack = PackedLinears(model)
    attention = model.model.layers[0].self_attn
    layers = (attention.q_proj, attention.k_proj, attention.v_proj)
    x = torch.randn(3, attention.q_proj.in_features).to(torch.bfloat16)
    seen = []
    handle = attention.k_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    try:
        with torch.inference_mode(), entered([pack]):
            outs = pack.products(layers, x)
    finally:
        handle.remove()
    assert seen == [(3, attention.k_proj.out_features)]  # called on its own: its hook ran
    assert all(torch.equal(out, F.linear(x, layer.weight)) for out, layer in zip(outs, layers))


@pytest.mark.skipif(not ONEDNN, reason="no oneDNN on this build")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_generation_with_packed_weights_is_transformers_greedy_output(monkeypatch, arch):
    """float32 weights large enough to pack (from 2 rows, within float32 rounding of the plain kernel): the tree
    methods' greedy output is still `target.generate`'s, token for token, and the packed layers did run."""
    from helpers import hf_greedy

    target = tiny_model(arch, hidden=384, seed=0, init=0.05)
    draft = tiny_model(arch, hidden=384, layers=1, seed=1, init=0.05)
    prompt = torch.tensor([[1, 5, 9, 13, 2, 7, 5, 9, 13]])
    reference = hf_greedy(target, prompt, 32)
    calls = []
    original = packing._run_packed
    monkeypatch.setattr(packing, "_run_packed", lambda x, *a: calls.append(x.shape) or original(x, *a))
    for options in (dict(budget=8), dict(budget=40), dict(drafter="recycling+lookup", budget=16)):
        uses_draft = "drafter" not in options
        out = opttree.generate(target, prompt, draft if uses_draft else None, max_new_tokens=32, eos_token_id=[],
                               **options)
        assert torch.equal(out.sequences, reference), options
    assert any(shape[:-1].numel() >= packing.FLOAT32_MIN_ROWS for shape in calls)  # tree steps ran packed
