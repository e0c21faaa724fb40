"""The static path (static=True): padded trees over a preallocated cache, exact like the dynamic one."""

import pytest
import torch
from helpers import hf_greedy, tiny_model
from transformers import DynamicCache

import opttree
from opttree.speculator import use_static
from opttree.step.cache import cache_argument, capacity, compact, static_cache
from opttree.step.drafters import ModelDrafter, StaticModelDrafter
from opttree.step.tree import DraftTree, pad_nodes, padded_tree_mask, tree_attention_mask
from opttree.step.verify import Verification, verify_tree

ARCHS = ["llama", "qwen2", "gpt_neox", "phi3"]


def random_tree(n: int, g: torch.Generator) -> DraftTree:
    parents = torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)])
    depths = torch.zeros(n, dtype=torch.long)
    for i, p in enumerate(parents.tolist()):
        depths[i] = 1 if p < 0 else depths[p] + 1
    return DraftTree(torch.randint(3, 96, (n,), generator=g), parents, depths, torch.zeros(n), torch.arange(n))


def prompts(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (1, int(torch.randint(1, 20, (1,), generator=g))), generator=g) for _ in range(n)]


@pytest.mark.parametrize("n,width,prefix_len,capacity", [(0, 0, 5, 6), (0, 4, 3, 12), (5, 5, 7, 13), (6, 9, 2, 20)])
def test_padded_mask_is_the_tree_mask_then_self_attending_padding(n, width, prefix_len, capacity):
    tree = random_tree(n, torch.Generator().manual_seed(n + width))
    allowed = padded_tree_mask(tree.parents, prefix_len, width, capacity)
    assert allowed.shape == (width + 1, capacity)
    real = tree_attention_mask(tree.parents, prefix_len)  # (N+1, P+N+1)
    assert torch.equal(allowed[: n + 1, : prefix_len + n + 1], real)
    assert not allowed[: n + 1, prefix_len + n + 1 :].any()
    for row in range(n + 1, width + 1):  # brute force: a padding row sees its own slot, nothing else
        expected = torch.zeros(capacity, dtype=torch.bool)
        expected[prefix_len + row] = True
        assert torch.equal(allowed[row], expected)
    assert torch.equal(pad_nodes(torch.arange(n + 1), width, -7)[n + 1 :], torch.full((width - n,), -7))


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_forward_and_in_place_compaction_match_the_dynamic_cache(arch):
    """Logits of a padded tree forward, then of the next step after compaction, equal the dynamic path's."""
    model = tiny_model(arch, seed=3, layers=2, hidden=64)
    g = torch.Generator().manual_seed(1)
    prefix, tree = torch.randint(3, 96, (11,), generator=g), random_tree(7, g)
    keep = torch.tensor([0, 2, 5])  # rows of [root] + nodes: root, then two nodes (any increasing rows)
    caches = {"dynamic": DynamicCache(), "static": static_cache(model, 13 + 12 + 1)}
    logits = {}
    with torch.inference_mode():
        for name, cache in caches.items():
            model(input_ids=prefix[None, :-1], position_ids=torch.arange(10)[None], **{cache_argument(model): cache})
            first = verify_tree(model, cache, prefix[-1], tree, 10, width=12)
            compact(cache, 10, keep)
            second = verify_tree(model, cache, torch.tensor(5), tree, 13, width=12)
            logits[name] = first, second
    assert logits["static"][0].shape == (8, 96)
    for a, b in zip(logits["static"], logits["dynamic"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_the_static_draft_gives_the_dynamic_drafts_log_probabilities_and_grows_when_full(arch):
    """The draft over a preallocated cache with padded fixed-shape forwards (`StaticModelDrafter`: what a
    static-path generation drafts with) returns what the dynamic drafter returns, step after step: the
    prompt, roots of several new tokens, tree layers, compaction to the accepted path, and a cache that
    grows a capacity bucket on the way (a 250-token prompt in 256 positions)."""
    model = tiny_model(arch, seed=5)
    prompt = torch.randint(3, 96, (250,), generator=torch.Generator().manual_seed(2))
    drafters = {"dynamic": ModelDrafter(model), "static": StaticModelDrafter(model, positions=1, root_rows=4)}
    outs = {}
    with torch.inference_mode():
        for name, drafter in drafters.items():
            committed, outs[name] = prompt, []
            drafter.start(committed)
            for _ in range(3):
                outs[name].append(drafter.root(committed))  # (V,)
                outs[name].append(drafter.expand(torch.tensor([3, 4, 5]), torch.tensor([-1, -1, -1])))  # slots 0-2
                outs[name].append(drafter.expand(torch.tensor([6, 7]), torch.tensor([1, 0])))  # slots 3, 4
                path = DraftTree(torch.tensor([4, 6, 9]), torch.tensor([-1, 0, 1]), torch.tensor([1, 2, 3]),
                                 torch.zeros(3), draft_slots=torch.tensor([1, 3, -1]))  # 4 -> 6 -> an unrun leaf
                drafter.observe(Verification(committed[-1], path, torch.zeros(4, 96), torch.arange(3), torch.tensor(11)))
                committed = torch.cat([committed, torch.tensor([4, 6, 9, 11])])
    assert capacity(drafters["static"].cache) == 512  # grown from 256 by the first tree
    for got, expected in zip(outs["static"], outs["dynamic"], strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_draft_drafts_in_fixed_shapes_only_when_compiled_for_them():
    """A static-path generation's draft model drafts over its own preallocated cache once it has a
    compiled fixed-shape step (`compile_model(draft)`, CUDA graphs on a GPU); otherwise over its
    growing cache (on a CPU the padding costs more than it saves)."""
    target = tiny_model("llama", seed=1, layers=1, hidden=32)
    draft = tiny_model("llama", seed=2, layers=1, hidden=32)
    speculator = opttree.Speculator(target, draft, static=True, budget=4, max_new_tokens=4)
    request = opttree.Request(torch.arange(3, 9))
    assert type(speculator.stream(request).rows[0].drafter) is ModelDrafter
    opttree.compile_model(draft)
    assert type(speculator.stream(request).rows[0].drafter) is StaticModelDrafter
    assert type(opttree.Speculator(target, draft, static=False).stream(request).rows[0].drafter) is ModelDrafter


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt_neox"])
def pair(request):
    return tiny_model(request.param, seed=1, layers=2, hidden=64), tiny_model(request.param, seed=2, layers=1, hidden=32)


@pytest.mark.parametrize("tree,budget", [("opt", 6), ("chain", 3), ("eagle2", 8), ("static", 10), ("sequoia", 8),
                                         ("dyspec", 8), ("ar", 4)])
def test_greedy_identity_on_the_static_path(pair, tree, budget):
    target, draft = pair
    for prompt in prompts(1, seed=budget):
        ref = hf_greedy(target, prompt, 24)
        out = opttree.generate(target, prompt, draft, tree=tree, budget=budget, max_new_tokens=24, eos_token_id=[],
                               static=True)
        assert torch.equal(out.sequences, ref), (tree, prompt)


def test_greedy_identity_with_train_free_sources_on_the_static_path():
    target = tiny_model("llama", seed=1, layers=2, hidden=64)
    for prompt in prompts(3, seed=4):
        prompt = torch.cat([prompt, prompt], dim=1)  # repeats, so lookup proposes
        out = opttree.generate(target, prompt, drafter="recycling+lookup", budget=8, max_new_tokens=24,
                               eos_token_id=[], static=True)
        assert torch.equal(out.sequences, hf_greedy(target, prompt, 24))


@pytest.mark.parametrize("tree,budget", [("opt", 5), ("sequoia", 6), ("chain", 3)])
def test_sampling_is_the_same_draw_with_and_without_the_static_path(tree, budget):
    """Same logits, same verifier, same generator: seeded samples coincide, token for token. So the static
    path samples the distribution the chi-square tests check on the dynamic one (and they pass on it
    too: `OPTTREE_STATIC=1 python -m pytest -q`)."""
    target, draft = tiny_model("llama", seed=5, layers=2, hidden=64), tiny_model("llama", seed=6, layers=1, hidden=32)
    for seed in range(2):
        prompt = prompts(1, seed=seed)[0]
        runs = [opttree.generate(target, prompt, draft, tree=tree, budget=budget, max_new_tokens=20, temperature=0.9,
                                 top_k=40, seed=seed, eos_token_id=[], static=static).sequences for static in (False, True)]
        assert torch.equal(*runs), (tree, seed)


def test_compiled_static_step_is_exact_compiles_once_per_bucket_and_turns_the_static_path_on(monkeypatch):
    """Prompts of different lengths share a capacity bucket: one compiled graph, the same tokens."""
    import torch._dynamo

    monkeypatch.delenv("OPTTREE_STATIC", raising=False)
    target = tiny_model("llama", seed=1, layers=1, hidden=32)
    draft = tiny_model("llama", seed=2, layers=1, hidden=32)
    ids = [torch.arange(3, 3 + length)[None] for length in (3, 9, 17)]
    refs = [hf_greedy(target, prompt, 12) for prompt in ids]
    assert use_static(None, target) is False
    opttree.compile_model(target)  # the fixed-shape step; the forward stays eager
    assert use_static(None, target) is True and use_static(False, target) is False
    opttree.compile_model(draft)  # the draft's fixed-shape steps: a root's rows and a tree layer's
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs = []
    for prompt, ref in zip(ids, refs):
        out = opttree.generate(target, prompt, draft, budget=4, max_new_tokens=12, eos_token_id=[])
        assert torch.equal(out.sequences, ref)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs == [3, 3, 3]  # the target's step, the draft's root and tree layer: none after the first prompt


def test_the_environment_forces_the_static_path_both_ways(monkeypatch):
    target = tiny_model("llama", seed=1, layers=1, hidden=32)
    monkeypatch.setenv("OPTTREE_STATIC", "1")
    assert use_static(None, target) is True and use_static(False, target) is False
    monkeypatch.setenv("OPTTREE_STATIC", "0")
    assert use_static(None, target) is False
    monkeypatch.setenv("OPTTREE_STATIC", "yes")
    with pytest.raises(ValueError, match="OPTTREE_STATIC must be 1 or 0"):
        use_static(None, target)


def test_bad_static_values_and_the_early_exit_source_are_refused(tmp_path):
    target = tiny_model("llama", seed=1, layers=2, hidden=64)
    prompt = prompts(1, seed=0)[0]
    with pytest.raises(ValueError, match="static must be True, False or None"):
        opttree.generate(target, prompt, drafter="lookup", static="yes")
    from opttree.step.drafters.early_exit import ExitLayer

    ExitLayer(target, 1).save(tmp_path, target)
    with pytest.raises(ValueError, match="static=True does not combine with drafter='early-exit'"):
        opttree.generate(target, prompt, drafter="early-exit", early_exit=str(tmp_path), static=True)


def test_compiling_allows_more_than_dynamos_eight_versions_per_code_object():
    """Every model's forward is one code object to dynamo, which runs calls eager, silently, past its
    limit of compiled versions (8): a target's steps and a draft's call patterns exceed it (measured:
    scripts/cpu_compile_bench.py ran its third compiled pair eager before this)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 8
    opttree.compile_model(tiny_model("llama", seed=1, layers=1, hidden=32))
    assert torch._dynamo.config.recompile_limit >= 64


def test_capacity_buckets_stay_inside_the_context_window():
    from opttree.step.cache import static_capacity

    assert [static_capacity(n) for n in (1, 256, 257, 1000)] == [256, 256, 512, 1024]
    assert static_capacity(100, limit=128) == 128  # a bucket past the window is cut to it
    assert static_capacity(300, limit=128) == 512  # positions past the window: refused elsewhere, not here


def test_a_model_the_static_path_cannot_drive_is_refused_when_asked_and_skipped_when_chosen(monkeypatch):
    """GPT-Neo's local window counts cache rows: a preallocated cache is not exact; it runs as chains."""
    from arch_configs import tiny_any_attention

    model = tiny_any_attention("gpt_neo", window_size=32)  # layers: global, local
    prompt = torch.tensor([[1, 5, 7, 9, 11, 13]])
    with pytest.raises(ValueError, match="static=True does not combine with a target verified as chains"):
        opttree.generate(model, prompt, model, max_new_tokens=8, eos_token_id=[], budget=4, static=True)
    monkeypatch.setenv("OPTTREE_STATIC", "1")
    out = opttree.generate(model, prompt, model, max_new_tokens=8, eos_token_id=[], budget=4)
    assert torch.equal(out.sequences, hf_greedy(model, prompt, 8))
