"""The tree forward without transformers' wrapping (`opttree.step.lean`): the model's own logits and cache,
bit for bit, and the model's own forward wherever something could hang on the wrapping."""

import pytest
import torch
from helpers import tiny_model

from opttree.counters import StepCounter
from opttree.step.cache import cache_argument, new_cache
from opttree.step.lean import lean_forward
from opttree.step.verify import attention_bias


def mha_model(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, max_position_embeddings=512, initializer_range=0.2)
    return LlamaForCausalLM._from_config(config, attn_implementation=attn).eval()


def tree_inputs(model, rows: int, prefix: int, seed: int):
    """A cached prefix per row, then 5 tree tokens (a root with two branches) under a 4D mask as
    `masked_forward` builds it."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1, 0, 0, 1, 2]  # node i's parent among the new tokens (-1: the prefix only)
    allowed = torch.zeros(5, prefix + 5, dtype=torch.bool)
    allowed[:, :prefix] = True
    depth = []
    for i, parent in enumerate(parents):
        allowed[i, prefix + i] = True
        if parent >= 0:
            allowed[i, prefix:] |= allowed[parent, prefix:]
        depth.append(0 if parent < 0 else depth[parent] + 1)
    positions = torch.tensor([prefix + d for d in depth])
    mask = torch.cat([attention_bias(model, allowed, positions)] * rows)  # (rows, 1, 5, prefix + 5)
    return (torch.randint(0, 96, (rows, prefix), generator=g), torch.randint(0, 96, (rows, 5), generator=g),
            positions.expand(rows, 5), mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch,rows", [("llama", 1), ("llama", 2), ("mha", 1), ("qwen2", 1), ("mistral", 2)])
@pytest.mark.parametrize("new", ["tree", "one", "causal", "prefill"])
def test_lean_forward_gives_the_models_logits_and_cache_bit_for_bit(dtype, attn, arch, rows, new):
    """A tree under its 4D mask, or with no mask (the model's own): one token (plain decoding), three with the
    last one's logits only (a root forward), or a prompt's prefill into an empty cache (the last two's logits)."""
    model = mha_model(attn) if arch == "mha" else tiny_model(arch, seed=4, attn=attn)  # tiny_model: 4 heads, 2 KV heads
    model = model.to(dtype)
    prefix, tokens, positions, mask = tree_inputs(model, rows, 7, seed=1)
    if new in ("one", "causal"):
        width = 1 if new == "one" else 3
        tokens, positions, mask = tokens[:, :width], torch.arange(7, 7 + width).expand(rows, width), None
    if new == "prefill":
        tokens, positions, mask = prefix, torch.arange(7).expand(rows, 7), None
    caches = [new_cache(), new_cache()]
    with torch.inference_mode():
        for cache in caches if new != "prefill" else ():
            model(input_ids=prefix, **{cache_argument(model): cache})
        runner = lean_forward(model, mask)
        assert runner is not None
        kwargs = dict(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                      output_hidden_states=True, **{"causal": {"logits_to_keep": 1}, "prefill": {"logits_to_keep": 2}}.get(new, {}))
        want = model(**kwargs, **{cache_argument(model): caches[0]})
        got = runner(**kwargs, **{cache_argument(model): caches[1]})
    assert got.logits.dtype == want.logits.dtype and torch.equal(got.logits, want.logits)
    assert len(got.hidden_states) == len(want.hidden_states) == len(model.model.layers) + 1
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(got.hidden_states, want.hidden_states))
    for mine, theirs in zip(caches[1].layers, caches[0].layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_the_models_own_forward_runs_wherever_something_hangs_on_it(monkeypatch):
    model = tiny_model("llama", seed=5)
    _, _, _, mask = tree_inputs(model, 1, 4, seed=2)
    assert lean_forward(model, mask) is not None
    assert lean_forward(model, {"full_attention": mask}) is None  # masks by layer type
    assert lean_forward(tiny_model("phi3"), mask) is None  # an architecture not listed
    with torch.inference_mode():  # transformers' hooks that collect hidden states stay, inactive: no matter
        model(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert model.model.layers[0]._forward_hooks and lean_forward(model, mask) is not None
    handle = model.model.layers[1].register_forward_hook(lambda module, args, output: None)
    assert lean_forward(model, mask) is None  # a hook on a skipped forward
    handle.remove()
    attention = model.model.layers[0].self_attn
    attention.forward = attention.forward  # a replaced forward (as accelerate's hooks and compile_model do)
    assert lean_forward(model, mask) is None
    del attention.forward
    assert lean_forward(model, mask) is not None
    monkeypatch.setenv("OPTTREE_LEAN", "0")  # turned off
    assert lean_forward(model, mask) is None
    monkeypatch.delenv("OPTTREE_LEAN")
    model.train()
    assert lean_forward(model, mask) is None


def test_the_lean_forwards_ops_count_as_a_models():
    """`opttree.counters` counts ops inside models' forwards apart from the step's machinery: the lean
    forward's own ops (residuals, reshapes, rotary) are a model's too."""
    model = tiny_model("llama", seed=6)
    prefix, tokens, positions, mask = tree_inputs(model, 1, 5, seed=3)
    cache = new_cache()
    with torch.inference_mode():
        model(input_ids=prefix, **{cache_argument(model): cache})
        runner = lean_forward(model, mask)
        with StepCounter() as counter:
            runner(input_ids=tokens, position_ids=positions, attention_mask=mask, **{cache_argument(model): cache})
    assert counter.ops > 50 and counter.machinery_ops == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_rotary_embedding_in_four_ops_is_the_models_bit_for_bit(dtype):
    """`apply_rotary` against each lean architecture's own `apply_rotary_pos_emb`, on transposed queries and keys as
    the attention holds them (grouped-query: fewer key heads), random cos / sin: equal bit for bit."""
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2

    from opttree.step.lean import apply_rotary, signed_sin

    g = torch.Generator().manual_seed(5)
    query = torch.randn(2, 7, 4, 16, generator=g).to(dtype).transpose(1, 2)  # (B, H, Q, Dh)
    key = torch.randn(2, 7, 2, 16, generator=g).to(dtype).transpose(1, 2)
    cos, sin = (torch.randn(2, 7, 16, generator=g).to(dtype) for _ in range(2))  # (B, Q, Dh)
    got = apply_rotary(query, cos[:, None], signed_sin(sin)[:, None]), apply_rotary(key, cos[:, None],
                                                                                   signed_sin(sin)[:, None])
    for modeling in (modeling_llama, modeling_qwen2, modeling_mistral):
        want = modeling.apply_rotary_pos_emb(query, key, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), modeling.__name__


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_riders_get_the_logits_and_cache_of_their_own_forwards(dtype, tolerance, arch):
    """Prompts prefilled in a tree forward's products (`lean.Rider`): the tree's logits, hidden states and cache and
    the riders' kept logits and caches are those of forwards of their own, up to the rounding of products over more
    rows."""
    from opttree.step.lean import Rider

    model = tiny_model(arch, seed=4).to(dtype)
    prefix, tokens, positions, mask = tree_inputs(model, 2, 7, seed=1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (1, 11), generator=g), torch.randint(0, 96, (2, 6), generator=g)]
    caches = [new_cache(), new_cache()]
    riders = [Rider(p, torch.arange(p.shape[1]).expand(p.shape[0], -1), new_cache(), keep)
              for p, keep in zip(prompts, (4, 6))]
    alone = [new_cache() for _ in prompts]
    with torch.inference_mode():
        for cache in caches:
            model(input_ids=prefix, **{cache_argument(model): cache})
        runner = lean_forward(model, mask)
        kwargs = dict(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                      output_hidden_states=True)
        want = runner(**kwargs, **{cache_argument(model): caches[0]})
        got = runner(**kwargs, **{cache_argument(model): caches[1]}, riders=riders)
        theirs = [model(input_ids=p, position_ids=torch.arange(p.shape[1]).expand(p.shape[0], -1),
                        **{cache_argument(model): cache}).logits for p, cache in zip(prompts, alone)]
    close = lambda a, b: torch.allclose(a.float(), b.float(), atol=tolerance, rtol=tolerance)  # noqa: E731
    assert close(got.logits, want.logits) and all(map(close, got.hidden_states, want.hidden_states))
    for rider, logits, cache in zip(riders, theirs, alone):
        assert rider.logits.shape == (logits.shape[0], rider.keep, logits.shape[2])
        assert close(rider.logits, logits[:, -rider.keep:])
        for mine, own in zip(rider.cache.layers, cache.layers, strict=True):
            assert close(mine.keys, own.keys) and close(mine.values, own.values)
    for mine, theirs_ in zip(caches[1].layers, caches[0].layers, strict=True):
        assert close(mine.keys, theirs_.keys) and close(mine.values, theirs_.values)
