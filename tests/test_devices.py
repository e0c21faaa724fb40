"""The engine runs on the target's device: greedy identity, seeded sampling and the draft on another device.

Parametrised over every device present: the CPU always, CUDA wherever it is available (these tests
are how a GPU machine checks exactness: `python -m pytest tests/test_devices.py`).
"""

import pytest
import torch
from helpers import hf_greedy, tiny_model

import opttree

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def prompts(n: int, seed: int = 0, vocab: int = 96):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, int(torch.randint(2, 20, (1,), generator=g))), generator=g) for _ in range(n)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
@pytest.mark.parametrize("tree", ["opt", "eagle2", "dyspec", "static", "chain"])
def test_greedy_identity_on_device(device, arch, tree):
    target = tiny_model(arch, seed=1, layers=2, hidden=64).to(device)
    draft = tiny_model(arch, seed=2, layers=1, hidden=32).to(device)
    for prompt in prompts(2, seed=3):
        prompt = prompt.to(device)
        ref = hf_greedy(target, prompt, 24)
        out = opttree.generate(target, prompt, draft, tree=tree, budget=8, delta=0.05, max_new_tokens=24,
                               eos_token_id=[])
        assert out.sequences.device == prompt.device
        assert torch.equal(out.sequences, ref), (device, arch, tree)


@pytest.mark.parametrize("device", DEVICES)
def test_prompt_on_the_cpu_for_a_model_elsewhere(device):
    """The prompt may come from the tokenizer (CPU): the engine moves it to the target's device."""
    target = tiny_model("llama", seed=1).to(device)
    prompt = prompts(1, seed=4)[0]
    out = opttree.generate(target, prompt, target, budget=4, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(out.sequences.cpu(), hf_greedy(target, prompt.to(device), 12).cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tree", ["opt", "sequoia"])
def test_sampling_is_seeded_on_device(device, tree):
    """Sampling draws from a per-request generator on the target's device: same seed, same output."""
    target = tiny_model("llama", seed=1, init=0.05).to(device)
    draft = tiny_model("llama", seed=2, layers=1, hidden=32, init=0.05).to(device)
    prompt = prompts(1, seed=5)[0]
    runs = [opttree.generate(target, prompt, draft, tree=tree, budget=6, temperature=1.0, top_p=0.9, seed=s,
                             max_new_tokens=16, eos_token_id=[]).sequences for s in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


@needs_cuda
def test_draft_on_another_device():
    """A draft on the CPU with the target on the GPU (or the reverse): trees move to the target."""
    target = tiny_model("llama", seed=1, layers=2, hidden=64)
    draft = tiny_model("llama", seed=2, layers=1, hidden=32)
    prompt = prompts(1, seed=6)[0]
    ref = hf_greedy(target, prompt, 24)
    for target_device, draft_device in (("cuda", "cpu"), ("cpu", "cuda")):
        out = opttree.generate(target.to(target_device), prompt, draft.to(draft_device), budget=8,
                               max_new_tokens=24, eos_token_id=[])
        assert torch.equal(out.sequences.cpu(), ref)


@needs_cuda
def test_host_syncs_per_step_are_few():
    """Host-device synchronisations in the hot path are counted (torch's sync debug mode) and bounded:
    OPT-Tree needs one per draft layer (its delta test) plus the acceptance decision."""
    import warnings

    target = tiny_model("llama", seed=1, layers=2, hidden=64).to("cuda")
    prompt = prompts(1, seed=7)[0].to("cuda")
    run = opttree.stream(target, prompt, target, budget=8, delta=0.0, max_depth=4, max_new_tokens=40,
                         eos_token_id=[])
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in run:
                pass
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught) / run.stats.steps
    print(f"host syncs per step: {syncs:.1f}")
    assert syncs <= 24


def test_inflated_target_computes_the_same_function():
    """`opttree train inflate`: wider, deeper, more heads, same logits and the same greedy tokens."""
    from opttree.train.inflate import inflate

    small = tiny_model("llama", seed=1, layers=2, hidden=64)
    big = inflate(small, hidden=128, intermediate=320, layers=4)
    assert big.config.num_attention_heads == 2 * small.config.num_attention_heads
    assert sum(p.numel() for p in big.parameters()) > 3 * sum(p.numel() for p in small.parameters())
    ids = prompts(1, seed=8)[0]
    with torch.inference_mode():
        torch.testing.assert_close(big(ids).logits, small(ids).logits, atol=1e-4, rtol=1e-4)
    out = opttree.generate(big, ids, small, budget=8, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(out.sequences, hf_greedy(small, ids, 24))


def test_compiled_models_stay_exact():
    """`compile_model(static=False)` (--compile --no-static): torch.compile'd forwards with trees of changing
    size, same tokens (the static step: tests/test_static.py)."""
    from opttree.device import compile_model

    target = tiny_model("llama", seed=1, layers=2, hidden=64)
    draft = tiny_model("llama", seed=2, layers=1, hidden=32)
    refs = [(p, hf_greedy(target, p, 16)) for p in prompts(1, seed=9)]
    compile_model(target, static=False)  # the draft's forward compiles the same way (one compile is enough here)
    for prompt, ref in refs:
        out = opttree.generate(target, prompt, draft, budget=8, max_new_tokens=16, eos_token_id=[])
        assert torch.equal(out.sequences, ref)


@needs_cuda
def test_graph_captured_static_step_is_exact_and_never_recompiles():
    """`compile_model` on CUDA: the target's and the draft's fixed-shape steps under CUDA graphs
    (torch.compile's reduce-overhead), exact in float32 against transformers' generate, for 20 prompt
    lengths of one capacity bucket with one compiled graph for the target's step and two for the
    draft's (a root's rows, a tree layer) (counted), under OPT-Tree and the train-free sources."""
    import torch._dynamo

    target = tiny_model("llama", seed=1, layers=2, hidden=64).to("cuda")
    draft = tiny_model("llama", seed=2, layers=1, hidden=32).to("cuda")
    lengths = list(range(3, 63, 3))  # 20 lengths, one bucket
    ids = [(torch.arange(length, device="cuda") % 11 + 3)[None] for length in lengths]
    refs = [hf_greedy(target, prompt, 24) for prompt in ids]
    opttree.compile_model(target)
    opttree.compile_model(draft)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for method in (dict(), dict(drafter="recycling+lookup")):
        for prompt, ref in zip(ids, refs):
            out = opttree.generate(target, prompt, draft if not method else None, budget=8, max_new_tokens=24,
                                   eos_token_id=[], **method)
            assert torch.equal(out.sequences, ref), (prompt.shape[1], method)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", [dict(), dict(drafter="recycling+lookup"), dict(tree="ar")], ids=str)
def test_a_batch_on_device_is_every_prompts_own_greedy_output(device, method):
    """Prompts of different lengths in one generation on the device: each row is what transformers'
    generate gives that prompt alone."""
    target = tiny_model("qwen2", seed=1, layers=2, hidden=64).to(device)
    draft = tiny_model("qwen2", seed=2, layers=1, hidden=32).to(device)
    batch = [prompt[0].to(device) for prompt in prompts(5, seed=11)]
    outs = opttree.generate(target, batch, None if method else draft, budget=8, max_new_tokens=24, eos_token_id=[],
                            **method)
    for prompt, out in zip(batch, outs):
        assert torch.equal(out.sequences, hf_greedy(target, prompt[None], 24)), (prompt.shape[0], method)
