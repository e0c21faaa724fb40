"""A draft's forward in fewer ops (`opttree.step.draft_forward`): the model's function up to rounding, its
cache as the model fills it, fewer ops than the model's own forward, and only where it computes that."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from helpers import tiny_model
from test_lean import mha_model, tree_inputs

from opttree.step.cache import cache_argument, new_cache
from opttree.step.draft_forward import draft_forward
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
def test_the_draft_forward_computes_the_models_logits_and_cache(dtype, attn, arch, rows, new):
    """A tree under its 4D mask, one token, or three with no mask (the model's causal one) and the last
    one's logits only (a root forward)."""
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


class _Products(TorchDispatchMode):
    """Counts the matrix products dispatched while active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in ("linear", "mm", "addmm", "_linear_pointwise")
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
                with _Products() as products:
                    runner(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache)
            counts.append((products.count, len(calls)))
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


def test_a_changed_weight_is_copied_again():
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
