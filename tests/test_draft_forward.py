"""A draft's forward in fewer ops (`opttree.step.draft_forward`): the model's function up to rounding, its
cache as the model fills it, fewer ops than the model's own forward, and only where it computes that."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from helpers import hf_greedy, tiny_model
from test_lean import mha_model, tree_inputs

import opttree
from opttree.step.cache import cache_argument, new_cache
from opttree.step.draft_forward import INT8_ROWS, _Product, draft_forward
from opttree.step.drafters.model import ModelDrafter, StaticModelDrafter
from opttree.step.lean import lean_forward


def model_for(arch: str, attn: str = "sdpa", dtype=torch.float32):
    if arch == "mha":
        model = mha_model(attn)
    elif arch == "mistral":  # full attention (a window is not driven here)
        model = tiny_model("mistral", seed=4, attn=attn, sliding_window=None)
    elif arch == "qwen2":  # q, k, v with biases
        model = tiny_model("qwen2", seed=4, attn=attn)
    else:
        model = tiny_model(arch, seed=4, attn=attn)  # 4 heads, 2 KV heads
    return model.to(dtype)


# float32: the same function, other roundings; bfloat16: the residual stream kept in float32 moves logits a little
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=0.15, rtol=0.05)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch,rows", [("llama", 1), ("llama", 2), ("mha", 1), ("qwen2", 1), ("mistral", 2)])
@pytest.mark.parametrize("new", ["tree", "one", "causal"])
def test_the_draft_forward_computes_the_models_logits_and_cache(dtype, attn, arch, rows, new, monkeypatch):
    """A tree under its 4D mask, one token, or three with no mask (the model's causal one) and the last
    one's logits only (a root forward). Without the int8 copies: their own test is below."""
    monkeypatch.setenv("OPTTREE_DRAFT_INT8", "0")
    model = model_for(arch, attn, dtype)
    prefix, tokens, positions, mask = tree_inputs(model, rows, 7, seed=1)
    if new != "tree":
        width = 1 if new == "one" else 3
        tokens, positions, mask = tokens[:, :width], torch.arange(7, 7 + width).expand(rows, width), None
    caches = [new_cache(), new_cache()]
    runner = draft_forward(model)
    assert runner is not None
    with torch.inference_mode():
        for cache in caches:
            model(input_ids=prefix, **{cache_argument(model): cache})
        kwargs = dict(input_ids=tokens, position_ids=positions, attention_mask=mask,
                      **({"logits_to_keep": 1} if new == "causal" else {}))
        want = model(**kwargs, **{cache_argument(model): caches[0]}).logits
        got = runner(**kwargs, cache=caches[1]).logits
    assert got.shape == want.shape and got.dtype == torch.float32  # a draft's logits come in float32
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
    for mine, theirs in zip(caches[1].layers, caches[0].layers, strict=True):
        assert mine.keys.shape == theirs.keys.shape and mine.keys.dtype == theirs.keys.dtype
        torch.testing.assert_close(mine.keys.float(), theirs.keys.float(), **TOLERANCE[dtype])
        torch.testing.assert_close(mine.values.float(), theirs.values.float(), **TOLERANCE[dtype])


class _Kernels(TorchDispatchMode):
    """The names of the ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_it_stacks_the_products_that_share_an_input_and_calls_no_submodule():
    """q, k, v in one product and gate, up in one: 4 a layer and the head's, against 7 and 1; and no module
    of the model is called but the embedding and the activations (transformers' wrapping of each module is
    what a small forward's time goes to)."""
    model = tiny_model("llama", seed=6, layers=2)
    prefix, tokens, positions, mask = tree_inputs(model, 1, 5, seed=3)
    runners = (lean_forward(model, mask), draft_forward(model))
    with torch.inference_mode():  # once before: the rotary table is filled on the first call
        runners[1](input_ids=tokens, position_ids=positions, cache=new_cache())
    calls = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: calls.append(module))
    try:
        counts = []
        for runner in runners:
            cache = new_cache()
            with torch.inference_mode():
                model(input_ids=prefix, **{cache_argument(model): cache})
                calls.clear()
                with _Kernels() as kernels:
                    runner(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache)
            products = sum(name in ("linear", "mm", "addmm", "_linear_pointwise") for name in kernels.names)
            counts.append((products, len(calls)))
    finally:
        hook.remove()
    assert counts[0][0] == 2 * 7 + 1 and counts[1][0] == 2 * 4 + 1, counts
    assert counts[1][1] == 1 + 1 + 2 < counts[0][1], counts  # itself (a module: counted as a model), embedding, 2 acts


def test_it_applies_only_where_it_computes_the_models_function(monkeypatch):
    model = tiny_model("llama", seed=5)
    assert draft_forward(model) is not None
    assert draft_forward(tiny_model("mistral", seed=5)) is None  # a sliding window
    assert draft_forward(tiny_model("phi3", seed=5)) is None  # an architecture it does not know
    dynamic = tiny_model("llama", seed=5, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    assert draft_forward(dynamic) is None  # cos / sin that depend on the length
    handle = model.model.layers[1].register_forward_hook(lambda module, args, output: None)
    assert draft_forward(model) is None  # a hook it would skip
    handle.remove()
    monkeypatch.setenv("OPTTREE_DRAFT_FORWARD", "0")
    assert draft_forward(model) is None
    monkeypatch.delenv("OPTTREE_DRAFT_FORWARD")
    assert isinstance(ModelDrafter(model).forward, torch.nn.Module)
    assert StaticModelDrafter(model, positions=64).forward is None  # its fixed-shape step runs it


def test_a_changed_weight_is_copied_again(monkeypatch):
    monkeypatch.setenv("OPTTREE_DRAFT_INT8", "0")
    model = tiny_model("llama", seed=7)
    tokens, positions = torch.tensor([[3, 4, 5]]), torch.arange(3)[None]
    first = draft_forward(model)
    with torch.inference_mode():
        model.model.layers[0].mlp.up_proj.weight.mul_(2.0)  # trained or loaded in place
        runner = draft_forward(model)
        got = runner(input_ids=tokens, position_ids=positions, cache=new_cache()).logits
        want = model(input_ids=tokens).logits
    assert runner is not first
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


@pytest.fixture
def int8(monkeypatch):
    """The int8 copies on (tests/conftest.py turns them off for the other tests)."""
    monkeypatch.setenv("OPTTREE_DRAFT_INT8", "1")


@pytest.mark.parametrize("shape,bias", [((96, 64), False), ((200, 48), True), ((8192 // 16, 32), False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_product_of_few_rows_runs_from_int8_copies_within_their_rounding(shape, bias, dtype, int8, monkeypatch):
    """Up to INT8_ROWS rows read the int8 copy (one kernel call) and land within its rounding of the float product:
    each output off by at most half a quantization step of every weight it sums; more rows, or the copies turned
    off, take the float copies and compute the float product."""
    generator = torch.Generator().manual_seed(sum(shape))
    weight = torch.randn(shape, generator=generator).to(dtype)
    b = torch.randn(shape[0], generator=generator).to(dtype) if bias else None
    product = _Product(weight, b, packed=False)
    monkeypatch.setenv("OPTTREE_DRAFT_INT8", "0")
    float_only = _Product(weight, b, packed=False)
    step = weight.float().abs().amax(dim=1) / 127  # (out,) one quantization step of each output row's weights
    for rows in (1, INT8_ROWS, INT8_ROWS + 1, 16):
        x = torch.randn(2, rows, shape[1], generator=generator)[:1]  # (1, R, in): a batch axis, as a forward has
        want = x @ weight.float().t() + (b.float() if bias else 0)
        with torch.inference_mode(), _Kernels() as kernels:
            got = product(x)
        assert got.shape == (1, rows, shape[0]) and got.dtype == torch.float32
        int8 = "_weight_int8pack_mm" in kernels.names
        assert int8 == (rows <= INT8_ROWS), (rows, kernels.names)
        if int8:  # each weight off by up to half a step, the input, the scales and the output rounded to bf16
            bound = x.abs() @ (0.5 * step[:, None] + weight.float().abs() * 2**-7).t() + want.abs() * 2**-8 + 1e-3
            assert ((got - want).abs() <= bound).all(), (rows, (got - want).abs().max())
        else:
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
        with torch.inference_mode(), _Kernels() as kernels:
            plain = float_only(x)
        assert "_weight_int8pack_mm" not in kernels.names
        torch.testing.assert_close(plain, want, atol=1e-3, rtol=1e-4)


def test_the_draft_forward_with_int8_copies_stays_near_the_models_distribution(int8):
    """A root forward (one new token) of a float32 draft through its int8 copies: its next-token distribution
    within a total variation of 0.02 of the model's own, the same tokens in its top 3."""
    model = model_for("llama")
    prefix, tokens, positions, _ = tree_inputs(model, 1, 7, seed=2)
    caches, runner = [new_cache(), new_cache()], draft_forward(model)
    with torch.inference_mode():
        for cache in caches:
            model(input_ids=prefix, **{cache_argument(model): cache})
        kwargs = dict(input_ids=tokens[:, :1], position_ids=torch.arange(7, 8)[None])
        want = model(**kwargs, **{cache_argument(model): caches[0]}).logits[0, -1].softmax(-1)
        with _Kernels() as kernels:
            got = runner(**kwargs, cache=caches[1]).logits[0, -1].softmax(-1)
    assert kernels.names.count("_weight_int8pack_mm") == 2 * 4 + 1  # every product of it, the head's too
    assert 0.5 * (got - want).abs().sum() < 0.02
    assert set(got.topk(3).indices.tolist()) == set(want.topk(3).indices.tolist())


def test_weights_whose_inputs_the_int8_kernel_cannot_take_keep_their_float_copies(int8):
    """torch's int8 kernel needs the input size a multiple of 16 (others return garbage or crash): those
    weights never get an int8 copy, and their products stay the float ones."""
    weight = torch.randn(64, 40, generator=torch.Generator().manual_seed(3))
    product, x = _Product(weight, None, packed=False), torch.randn(1, 40)
    assert product.int8 is None
    with torch.inference_mode(), _Kernels() as kernels:
        got = product(x)
    assert "_weight_int8pack_mm" not in kernels.names
    torch.testing.assert_close(got, x @ weight.t(), atol=1e-4, rtol=1e-4)


def test_greedy_output_stays_exact_with_the_int8_copies_and_a_toggle_rebuilds_the_runner(int8, monkeypatch):
    """Only the draft reads the int8 copies, so the output is the target's own greedy one; turning them off (or
    on) between generations makes the drafter's runner again."""
    target, draft = tiny_model("llama", seed=8), tiny_model("llama", seed=9)
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(4))
    reference = hf_greedy(target, prompt, 24)
    with _Kernels() as kernels:
        out = opttree.generate(target, prompt, draft, tree="opt", budget=4, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(out.sequences, reference)
    assert "_weight_int8pack_mm" in kernels.names
    first = draft_forward(draft)
    monkeypatch.setenv("OPTTREE_DRAFT_INT8", "0")
    assert draft_forward(draft) is not first and draft_forward(draft).int8_copies is False


@pytest.mark.parametrize("runs_draft_forward", [True, False])
def test_a_chains_next_node_by_extend_is_expand_of_it_under_the_last_slot(runs_draft_forward, monkeypatch):
    """`ModelDrafter.extend` (plain next-token decoding, no tree mask) against `expand` of the same node under the last
    slot, along a chain of 4 from the root: the same distributions (float32), the same slots and cache; and a chain
    policy's step asks `extend` for its layers, never `expand`."""
    from opttree.step.policies.chain import Chain
    from opttree.settings.config import SpecConfig

    monkeypatch.setattr(ModelDrafter, "runs_draft_forward", runs_draft_forward)
    model = model_for("llama")
    committed = torch.randint(3, 96, (9,), generator=torch.Generator().manual_seed(6))
    chain = torch.tensor([5, 17, 40, 2])
    drafters = [ModelDrafter(model), ModelDrafter(model)]
    with torch.inference_mode():
        for drafter in drafters:
            drafter.start(committed)
            drafter.root(committed)
        for depth, token in enumerate(chain):
            got = drafters[0].extend(token.view(1))
            want = drafters[1].expand(token.view(1), torch.tensor([depth - 1]))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert torch.equal(drafters[0].slots.depths, drafters[1].slots.depths)
    for mine, theirs in zip(drafters[0].cache.layers, drafters[1].cache.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys)
    calls = []
    monkeypatch.setattr(ModelDrafter, "expand", lambda self, *a: calls.append("expand"))
    policy = Chain(SpecConfig(tree="chain", budget=3))
    with torch.inference_mode():
        drafters[0].start(committed)
        tree = policy.build(drafters[0], committed, 3)
    assert len(tree) == 3 and calls == [] and drafters[0].slots.size == 2  # two nodes ran, the leaf did not
