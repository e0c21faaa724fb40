"""A batch that keeps its keys and values in float32 (`opttree.step.lean.float32_attention`, `cache.stack_rows`):
where it applies, what the cache holds through growth, compaction and rows leaving, that the lean forward over it
computes the model's function, and a generation over it."""

import pytest
import torch
from helpers import tiny_model

import opttree
from opttree.step.cache import cache_argument, compact_rows, new_cache, select_rows, stack_rows
from opttree.step.lean import float32_attention, lean_forward


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv("OPTTREE_FLOAT32_ATTENTION", "1")


def prefilled(model, ids: torch.Tensor):
    cache = new_cache(model)
    with torch.inference_mode():
        model(input_ids=ids, **{cache_argument(model): cache})
    return cache


def test_it_applies_to_half_precision_cpu_models_that_the_lean_forward_drives(forced, monkeypatch):
    assert float32_attention(tiny_model().to(torch.bfloat16))
    assert float32_attention(tiny_model("qwen2").to(torch.float16))
    assert not float32_attention(tiny_model())  # float32 already
    assert not float32_attention(tiny_model(attn="eager").to(torch.bfloat16))  # not sdpa
    assert not float32_attention(tiny_model("gpt_neox").to(torch.bfloat16))  # a forward the lean one does not drive
    from opttree.step import lean

    model = tiny_model().to(torch.bfloat16)  # 2 layers x 2 KV heads x 16 x 2 x 4 bytes = 512 bytes a position
    monkeypatch.setattr(lean, "available_bytes", lambda: 4 * 512 * 1000)
    assert float32_attention(model, positions=1000) and not float32_attention(model, positions=1001)
    monkeypatch.setenv("OPTTREE_FLOAT32_ATTENTION", "0")
    assert not float32_attention(model)


def test_the_stacked_cache_stays_float32_through_growth_compaction_and_rows_leaving():
    model = tiny_model().to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    parts = [(prefilled(model, torch.randint(3, 96, (1, n), generator=g)), [n]) for n in (5, 9)]
    with torch.inference_mode():  # as a generation runs it
        cache = stack_rows(parts, torch.float32)
        want = [part.layers[0].keys[0, :, :n].float() for part, (n,) in parts]
        for layer in cache.layers:
            assert layer.keys.dtype == layer.values.dtype == torch.float32 and layer.keys.shape[2] == 9
        assert torch.equal(cache.layers[0].keys[0, :, :5], want[0]) and torch.equal(cache.layers[0].keys[1], want[1])
        for layer in cache.layers:  # past the buffers' room: new buffers, still float32
            new = torch.randn(2, layer.keys.shape[1], 100, layer.keys.shape[3], generator=g).to(torch.bfloat16)
            keys, values = layer.update(new, new)
            assert keys.dtype == torch.float32 and keys.shape[2] == 109
            assert torch.equal(keys[:, :, 9:], new.float())
        compact_rows(cache, [9, 9], 9, [torch.tensor([0, 2]), 1])
        select_rows(cache, [1], [10])
    assert all(layer.keys.dtype == torch.float32 and layer.keys.shape[0] == 1 and layer.keys.shape[2] == 10
               for layer in cache.layers)


def test_the_lean_forward_over_a_float32_cache_computes_the_models_function():
    """A bf16 model over a cache kept in float32 against the same weights in float32: no further from it than the
    bf16 model over its own bf16 cache (a wrong cast, mask or head order would be far off)."""
    reference = tiny_model(init=0.05)
    model = tiny_model(init=0.05).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (1, n), generator=g) for n in (6, 11)]
    new = torch.randint(3, 96, (2, 3), generator=g)
    positions = torch.tensor([[6, 7, 8], [11, 12, 13]])
    allowed = torch.zeros(2, 1, 3, 14, dtype=torch.bool)
    for row, n in enumerate((6, 11)):
        allowed[row, 0, :, :n] = True
        allowed[row, 0, :, 11:] = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    logits = {}
    for name, net, dtype in (("reference", reference, None), ("bf16 cache", model, None),
                             ("float32 cache", model, torch.float32)):
        with torch.inference_mode():
            cache = stack_rows([(prefilled(net, p), [p.shape[1]]) for p in prompts], dtype)
            out = lean_forward(net, allowed)(input_ids=new, position_ids=positions, attention_mask=allowed,
                                             **{cache_argument(net): cache})
        logits[name] = out.logits.float()
        assert out.logits.dtype == net.dtype
    error = {name: (logits[name] - logits["reference"]).abs().max().item() for name in ("bf16 cache", "float32 cache")}
    assert error["float32 cache"] <= 1.5 * error["bf16 cache"] + 1e-3, error


def test_a_bf16_batch_generates_over_a_float32_cache(forced):
    """The shipped pair in bf16, three prompts as one batch, plainly and with the default tree: the batch's cache
    is float32, and the rows' tokens are those of the same batch over a bf16 cache but where bf16's rounding
    decides a near-tie (at most a few tokens of 48)."""
    target, _, tokenizer = opttree.demo_models(dtype=torch.bfloat16)
    prompts = [tokenizer(text, return_tensors="pt").input_ids[0] for text in
               ("def add(a, b):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n")]
    for tree in ("ar", "opt"):
        run = opttree.stream(target, prompts, tree=tree, max_new_tokens=16)
        next(iter(run))
        assert all(layer.keys.dtype == torch.float32 for layer in run.cache.layers)  # one batch (similar lengths)
        half = [out.new_tokens.tolist() for out in opttree.generate(target, prompts, tree=tree, max_new_tokens=16)]
        full = [out.new_tokens.tolist() for out in run.finish()]
        assert sum(a == b for x, y in zip(half, full) for a, b in zip(x, y)) >= 44, (half, full)


def test_one_bf16_sequence_attends_over_float32_caches(forced):
    """One prompt of the shipped pair in bf16, with the draft model: after the prefill the target's cache and the
    draft's are float32, and the tokens are those over bf16 caches but where bf16's rounding decides a near-tie (at
    most a few of 24); the static path keeps the model's dtype (its compiled step reads a preallocated cache)."""
    target, draft, tokenizer = opttree.demo_models(dtype=torch.bfloat16)
    prompt = tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids
    for tree in ("ar", "chain"):
        run = opttree.stream(target, prompt, draft if tree != "ar" else None, tree=tree, budget=3, max_new_tokens=24)
        next(iter(run))
        assert all(layer.keys.dtype == layer.values.dtype == torch.float32 for layer in run.cache.layers)
        if tree != "ar":
            assert all(layer.keys.dtype == torch.float32 for layer in run.rows[0].drafter.cache.layers)
        full = run.finish().new_tokens.tolist()
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("OPTTREE_FLOAT32_ATTENTION", "0")
            half = opttree.generate(target, prompt, draft if tree != "ar" else None, tree=tree, budget=3,
                                    max_new_tokens=24).new_tokens.tolist()
        assert sum(a == b for a, b in zip(half, full)) >= 20, (half, full)
    run = opttree.stream(target, prompt, tree="ar", max_new_tokens=4, static=True)
    next(iter(run))
    assert all(layer.keys.dtype == torch.bfloat16 for layer in run.cache.layers)


def test_the_draft_forward_caches_float32_keys_where_it_pays_and_a_toggle_rebuilds_it(forced, monkeypatch):
    """A bf16 draft's own forward (`draft_forward`) over a float32 cache: its cache float32, its logits as near the
    float32 model's as over a bf16 cache; turning the switch off makes the runner again, in the model's dtype."""
    from opttree.step.draft_forward import draft_forward

    reference = tiny_model(init=0.05)
    model = tiny_model(init=0.05).to(torch.bfloat16)
    prefix = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    runner = draft_forward(model)
    assert runner.attention_dtype == torch.float32
    logits, dtypes = {}, {}
    for name, forward in (("float32 cache", runner), ("reference", reference)):
        cache = new_cache()
        with torch.inference_mode():
            argument = {cache_argument(reference): cache}
            out = forward(input_ids=prefix, position_ids=torch.arange(9)[None], **argument)
            out = forward(input_ids=prefix[:, :1], position_ids=torch.tensor([[9]]), **argument)
        logits[name], dtypes[name] = out.logits.float(), cache.layers[0].keys.dtype
    assert dtypes["float32 cache"] == torch.float32
    monkeypatch.setenv("OPTTREE_FLOAT32_ATTENTION", "0")
    bf16 = draft_forward(model)
    assert bf16 is not runner and bf16.attention_dtype == torch.bfloat16
    cache = new_cache()
    with torch.inference_mode():
        bf16(input_ids=prefix, position_ids=torch.arange(9)[None], cache=cache)
        plain = bf16(input_ids=prefix[:, :1], position_ids=torch.tensor([[9]]), cache=cache).logits.float()
    assert cache.layers[0].keys.dtype == torch.bfloat16
    error = {name: (got - logits["reference"]).abs().max().item() for name, got in
             (("float32 cache", logits["float32 cache"]), ("bf16 cache", plain))}
    assert error["float32 cache"] <= 1.5 * error["bf16 cache"] + 1e-3, error
