"""Cache compaction against recomputation, and acceptance against a brute-force walk."""

import pytest
import torch
from helpers import tiny_model
from test_tree import depths_of, random_parents

from opttree.step.cache import cache_argument, compact, new_cache
from opttree.step.drafters import ModelDrafter
from opttree.step.tree import DraftTree, leaf_paths
from opttree.step.verify import (
    HostMatch,
    StepReadout,
    Verification,
    greedy_choice,
    match_on_host,
    matching_path,
    verify_tree,
)


def brute_force_accept(tree, choice):
    accepted, node = [], -1
    while True:
        children = [i for i in range(len(tree)) if int(tree.parents[i]) == node]
        match = [i for i in children if int(tree.tokens[i]) == int(choice[node + 1])]
        if not match:
            return accepted, int(choice[node + 1])
        node = match[0]
        accepted.append(node)


def random_tree(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    parents = random_parents(n, seed)
    # distinct tokens among siblings, as top-k candidates are
    tokens = torch.empty(n, dtype=torch.long)
    for p in set(parents.tolist()):
        kids = (parents == p).nonzero().squeeze(1)
        tokens[kids] = torch.randperm(vocab, generator=g)[: kids.numel()]
    return DraftTree(tokens, parents, depths_of(parents), torch.zeros(n), torch.arange(n))


@pytest.mark.parametrize("seed", range(30))
def test_accept_matching_equals_walking_the_tree(seed):
    tree = random_tree(15, 6, seed)
    g = torch.Generator().manual_seed(100 + seed)
    # choices biased toward the drafted tokens so that long paths get accepted
    choice = torch.where(torch.rand(16, generator=g) < 0.7, torch.cat([tree.tokens[:1], tree.tokens]), torch.randint(0, 6, (16,), generator=g))
    path, length, bonus = matching_path(tree, choice)
    expected, expected_bonus = brute_force_accept(tree, choice)
    assert path[: int(length)].tolist() == expected and int(bonus) == expected_bonus
    assert path.shape == (15,)
    assert match_on_host(tree.tokens.tolist(), tree.parents.tolist(), choice.tolist()) == (expected, expected_bonus)


@pytest.mark.parametrize("seed", range(6))
def test_a_batch_readout_matches_on_the_host_what_the_device_matches(seed):
    """`StepReadout.read_rows` over a batch mixing rows matched on the device (a path) and on the host (`HostMatch`),
    empty trees included: each row's readout the same either way, and the host rows' path the one the device finds."""
    g = torch.Generator().manual_seed(seed)
    trees = [random_tree(n, 6, seed + n) if n else DraftTree.empty() for n in (15, 0, 4, 9)]
    drafted = [torch.cat([t.tokens[:1], t.tokens]) if len(t) else torch.zeros(1, dtype=torch.long) for t in trees]
    choices = [torch.where(torch.rand(len(d), generator=g) < 0.7, d, torch.randint(0, 6, (len(d),), generator=g))
               for d in drafted]
    on_device = StepReadout.read_rows([(t, matching_path(t, c)) for t, c in zip(trees, choices)])
    mixed = StepReadout.read_rows([(t, HostMatch(c) if i % 2 else matching_path(t, c))
                                   for i, (t, c) in enumerate(zip(trees, choices))])
    on_host = StepReadout.read_rows([(t, HostMatch(c)) for t, c in zip(trees, choices)])
    for device, other, host, tree, choice in zip(on_device, mixed, on_host, trees, choices):
        for got in (other, host):
            assert (got.accepted, got.emitted, got.slots, got.depth) == (device.accepted, device.emitted, device.slots,
                                                                          device.depth)
        path, length, _ = matching_path(tree, choice)
        assert host.path == path[: int(length)].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
@pytest.mark.parametrize("seed", range(3))
def test_compacted_cache_gives_the_logits_of_recomputation(arch, seed):
    model = tiny_model(arch, seed=seed)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 96, (11,), generator=g)
    tree = random_tree(14, 96, seed)
    with torch.inference_mode():
        cache = new_cache()
        model(input_ids=prompt[None, :-1], **{cache_argument(model): cache})
        verify_tree(model, cache, prompt[-1], tree, prompt.shape[0] - 1)
        leaf = int(leaf_paths(tree.parents, tree.depths)[-1].max())
        path = [leaf]
        while int(tree.parents[path[-1]]) >= 0:
            path.append(int(tree.parents[path[-1]]))
        path = torch.tensor(path[::-1])
        compact(cache, prompt.shape[0] - 1, torch.cat([torch.tensor([0]), path + 1]))
        committed = torch.cat([prompt, tree.tokens[path]])
        assert cache.get_seq_length() == committed.shape[0]
        nxt = torch.tensor([5])
        pos = torch.tensor([[committed.shape[0]]])
        got = model(input_ids=nxt[None], position_ids=pos, **{cache_argument(model): cache}).logits[0, -1]
        expected = model(input_ids=torch.cat([committed, nxt])[None]).logits[0, -1]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_drafter_cache_after_accept_matches_recomputation():
    model = tiny_model("llama", seed=5)
    drafter = ModelDrafter(model)
    prompt = torch.randint(0, 96, (8,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        drafter.start(prompt)
        drafter.root(prompt)
        first = drafter.expand(torch.tensor([3, 4, 5]), torch.tensor([-1, -1, -1]))  # slots 0-2
        drafter.expand(torch.tensor([6, 7]), torch.tensor([1, 0]))  # slots 3 (under 4), 4 (under 3)
        path = DraftTree(torch.tensor([4, 6, 9]), torch.tensor([-1, 0, 1]), torch.tensor([1, 2, 3]), torch.zeros(3),
                         draft_slots=torch.tensor([1, 3, -1]))  # accepted 4 -> 6 -> (an unexpanded leaf)
        drafter.observe(Verification(prompt[-1], path, torch.zeros(4, 96), torch.arange(3), torch.tensor(11)))
        committed = torch.cat([prompt, torch.tensor([4, 6, 9, 11])])  # + the leaf token and the bonus
        got = drafter.root(committed)
        expected = torch.log_softmax(model(input_ids=committed[None]).logits[0, -1], -1)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        causal = torch.log_softmax(model(input_ids=torch.cat([prompt, torch.tensor([4])])[None]).logits[0, -1], -1)
        torch.testing.assert_close(first[1], causal, atol=1e-4, rtol=1e-4)


def test_the_greedy_choice_is_the_first_of_equal_maxima_as_argmax_takes_it():
    """`greedy_choice` (max(dim)) against torch.argmax, transformers' greedy pick, on rows full of ties."""
    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        vocab, rows = int(torch.randint(2, 9000, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
        logits = torch.randint(-3, 3, (rows, vocab), generator=g).float()  # many equal maxima a row
        logits[:, int(torch.randint(0, vocab, (1,), generator=g))] = float("-inf")
        if trial % 2:
            logits = logits.to(torch.bfloat16)
        assert torch.equal(greedy_choice(logits), logits.float().argmax(dim=-1))


@pytest.mark.parametrize("starts,static", [([7], False), ([7], True), ([7, 7, 4], False), ([5, 7], False)])
def test_keeping_a_count_equals_keeping_those_offsets(starts, static):
    """`compact_rows` with a row's kept rows given as a count (the first K, known on the host: a row that
    accepted nothing keeps its root) leaves the cache as the offsets 0..K-1 do, whether the row stays in
    place (its start is the step's) or moves (a shorter row of a batch)."""
    import copy

    from opttree.step.cache import compact_rows, static_cache

    model = tiny_model("llama", seed=3)
    source, width = max(starts), 5
    ids = torch.randint(0, 96, (len(starts), source + width), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = static_cache(model, 64) if static else new_cache()
        model(input_ids=ids, **{cache_argument(model): cache})
        counts, offsets = copy.deepcopy(cache), copy.deepcopy(cache)
        chosen = [torch.tensor([0, 2, 3]) if b == 1 else 1 for b in range(len(starts))]  # row 1 keeps a path
        compact_rows(counts, starts, source, chosen)
        compact_rows(offsets, starts, source, [torch.arange(k) if isinstance(k, int) else k for k in chosen])
    assert counts.get_seq_length() == offsets.get_seq_length()
    for mine, theirs in zip(counts.layers, offsets.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_compacting_a_batch_moves_each_rows_kept_positions_as_one_row_at_a_time_does(seed, shared, monkeypatch):
    """A batch of rows with different starts, each keeping a count (in place or moved) or chosen offsets, compacted at
    once (`compact_rows`: every row's moves in one gather and one scatter, in the layers' shared buffer or layer by
    layer) against each row's keys and values moved on their own."""
    from opttree.step import cache as module
    from opttree.step.cache import compact_rows

    if not shared:
        monkeypatch.setattr(module, "CPU_SHARED_BYTES", 0)

    g = torch.Generator().manual_seed(seed)
    rows, source, width = 4, 9, 6
    starts = [source] + [int(torch.randint(3, source + 1, (1,), generator=g)) for _ in range(rows - 1)]
    keeps = []
    for _ in range(rows):
        k = int(torch.randint(1, width + 1, (1,), generator=g))
        keeps.append(k if torch.rand((), generator=g) < 0.3 else torch.randperm(width, generator=g)[:k].sort().values)
    model = tiny_model("llama", seed=3)
    ids = torch.randint(0, 96, (rows, source + width), generator=g)
    with torch.inference_mode():
        cache = new_cache()
        model(input_ids=ids, **{cache_argument(model): cache})
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        compact_rows(cache, starts, source, keeps)
    end = max(start + (k if isinstance(k, int) else k.shape[0]) for start, k in zip(starts, keeps))
    for layer, (keys, values) in zip(cache.layers, before):
        assert layer.keys.shape[2] == end
        for b, (start, keep) in enumerate(zip(starts, keeps)):
            kept = source + (torch.arange(keep) if isinstance(keep, int) else keep)  # (K,)
            for mine, theirs in ((layer.keys, keys), (layer.values, values)):
                assert torch.equal(mine[b, :, :start], theirs[b, :, :start])  # the prefix stays
                assert torch.equal(mine[b, :, start:start + kept.shape[0]], theirs[b, :, kept])


def _same_cache(mine, theirs) -> None:
    assert mine.get_seq_length() == theirs.get_seq_length()
    for a, b in zip(mine.layers, theirs.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_growing_layers_hold_what_transformers_layers_hold(monkeypatch):
    """`new_cache`'s layers (written in place) against transformers' `DynamicLayer` (concatenated) through
    what a generation does to them: a prefill, tree forwards, compaction, truncation, a batch made from
    copies and reordered, and growth past the first buffer. Equal keys, values and logits after each."""
    import copy

    from transformers import DynamicCache

    from opttree.step.cache import GrowingLayer, compact_rows, truncate

    monkeypatch.setattr(GrowingLayer, "HEADROOM", 4)  # buffers made again and again
    model = tiny_model("llama", seed=5)
    g = torch.Generator().manual_seed(0)
    mine, theirs = new_cache(), DynamicCache()

    def forward(ids):
        with torch.inference_mode():
            out = [model(input_ids=ids, **{cache_argument(model): cache}).logits for cache in (mine, theirs)]
        assert torch.equal(*out)
        _same_cache(mine, theirs)

    forward(torch.randint(0, 96, (1, 9), generator=g))
    assert all(isinstance(layer, GrowingLayer) for layer in mine.layers)
    rooms = set()
    for step in range(30):
        forward(torch.randint(0, 96, (1, 1 + step % 5), generator=g))
        start = mine.get_seq_length() - 1 - step % 5
        keep = torch.tensor([0, 2]) if step % 5 > 2 else (1 if step % 2 else torch.tensor([0]))
        with torch.inference_mode():
            for cache in (mine, theirs):
                compact_rows(cache, [start], start, [keep])
        _same_cache(mine, theirs)
        rooms.add(mine.layers[0]._store[0].shape[2])
        if step % 7 == 6:
            for cache in (mine, theirs):
                truncate(cache, cache.get_seq_length() - 2)
            _same_cache(mine, theirs)
    assert len(rooms) >= 3, rooms
    twin = copy.copy(mine.layers[0])  # a copy writes into buffers of its own
    for cache in (mine, theirs):
        cache.reorder_cache(torch.tensor([0, 0, 0]))  # a batch of three copies
    forward(torch.randint(0, 96, (3, 2), generator=g))
    assert twin._store is None and twin.keys.shape[0] == 1


def test_growing_layers_write_in_place_and_keep_earlier_views():
    """Decoding writes into the same buffer, an update concatenates nothing, and a view taken before an
    update keeps its values (a saved state stays valid)."""
    from opttree.step.cache import GrowingLayer

    model = tiny_model("llama", seed=6)
    cache = new_cache()
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 96, (1, 12), generator=g), **{cache_argument(model): cache})
        layer = cache.layers[0]
        before, saved = layer.keys.untyped_storage().data_ptr(), layer.keys.clone()
        view = layer.keys
        for _ in range(8):
            model(input_ids=torch.randint(0, 96, (1, 1), generator=g), **{cache_argument(model): cache})
        assert layer.keys.untyped_storage().data_ptr() == before and layer.keys.shape[2] == 20
        assert torch.equal(view, saved)
        alone = GrowingLayer()
        with torch.profiler.profile() as prof:
            for length in (5, 1, 1, 3):
                alone.update(torch.randn(1, 2, length, 4), torch.randn(1, 2, length, 4))
    assert alone.keys.shape == (1, 2, 10, 4)
    assert "aten::cat" not in {event.key for event in prof.key_averages()}


def test_stacked_and_selected_rows_stay_in_growing_buffers():
    """A batch made of two sequences' caches (`stack_rows`, as rows join) holds each row padded with zeros
    to the longest, in buffers with room, so the next forward writes in place; keeping some rows
    (`select_rows`, as rows leave) too. The rows' logits equal those of each sequence alone."""
    from opttree.step.cache import GrowingLayer, select_rows, stack_rows

    model = tiny_model("llama", seed=7)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (1, length), generator=g) for length in (5, 9)]
    alone = [new_cache() for _ in prompts]
    with torch.inference_mode():
        for ids, cache in zip(prompts, alone):
            model(input_ids=ids, **{cache_argument(model): cache})
        like = alone[1].layers[0].keys  # (1, H, 9, Dh); freed NaN buffers of the stack's size: memory it may reuse
        poison = [torch.full((2, like.shape[1], GrowingLayer.room(9), like.shape[3]), float("nan"))
                  for _ in range(4 * len(alone[1].layers))]
        del poison
        batch = stack_rows([(cache, [ids.shape[1]]) for ids, cache in zip(prompts, alone)])
        for layer, short, long in zip(batch.layers, *(cache.layers for cache in alone)):
            assert isinstance(layer, GrowingLayer) and layer.holds_views() and layer._store[0].shape[2] > 9
            assert torch.equal(layer.keys[0, :, :5], short.keys[0]) and not layer.keys[0, :, 5:].any()
            assert torch.equal(layer.values[0, :, :5], short.values[0]) and not layer.values[0, :, 5:].any()
            assert torch.equal(layer.keys[1], long.keys[0]) and torch.equal(layer.values[1], long.values[0])
        stores = [layer._store[0].untyped_storage().data_ptr() for layer in batch.layers]
        token = torch.randint(0, 96, (2, 1), generator=g)
        allowed = torch.zeros(2, 1, 1, 10, dtype=torch.bool)
        allowed[0, 0, 0, :5], allowed[0, 0, 0, 9], allowed[1] = True, True, True  # row 0's padding unseen
        positions = torch.tensor([[5], [9]])
        together = model(input_ids=token, position_ids=positions, attention_mask=allowed,
                         **{cache_argument(model): batch}).logits
        assert [layer._store[0].untyped_storage().data_ptr() for layer in batch.layers] == stores  # in place
        for b, cache in enumerate(alone):
            own = model(input_ids=token[b:b + 1], position_ids=positions[b:b + 1],
                        **{cache_argument(model): cache}).logits
            assert torch.allclose(together[b], own[0], atol=1e-5)
        select_rows(batch, [1], [10])
        for layer, long in zip(batch.layers, alone[1].layers):
            assert layer.holds_views() and torch.allclose(layer.keys, long.keys, atol=1e-5)


@pytest.mark.parametrize("shared", [True, False])
def test_rows_join_a_cache_with_room_in_place(shared, monkeypatch):
    """A batch's cache stacked with room for more rows (`stack_rows(rows_room=...)`, as the server's batches keep),
    its layers' keys and values in one buffer (`Arena`) or each in its own (a large batch's on a CPU): rows joining
    later are written into it after the running rows, which stay where they are (no copy); rows leaving move down in
    place, keeping the room. Each row holds its own states, padded with zeros to the longest (the room's rows and
    positions poisoned with NaN first: nothing unwritten is left where a forward reads), and every row's logits
    equal its sequence's alone."""
    from opttree.step import cache as caches
    from opttree.step.cache import GrowingLayer, select_rows, stack_rows

    if not shared:
        monkeypatch.setattr(caches, "CPU_SHARED_BYTES", 0)  # the layers' own buffers, as a large batch's on a CPU
    model = tiny_model("llama", seed=7)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (1, length), generator=g) for length in (5, 9, 7, 12)]
    alone = [new_cache() for _ in prompts]

    def buffers(batch) -> list[tuple[torch.Tensor, int]]:
        """The buffers holding the batch's rows, with their row axis."""
        arena = batch.layers[0]._arena
        assert (arena is not None) == shared
        return [(arena.buffer, 1)] if shared else [(buffer, 0) for layer in batch.layers for buffer in layer._store]

    def poison(batch, rows: int) -> None:  # NaN in the rows and positions of the room past the cached ones
        end = batch.layers[0].keys.shape[2]
        for buffer, axis in buffers(batch):
            shape = list(buffer.shape)
            shape[axis] = rows
            room = buffer.as_strided(shape, buffer.stride(), buffer.storage_offset())
            room.narrow(axis, buffer.shape[axis], rows - buffer.shape[axis]).fill_(float("nan"))
            buffer.narrow(axis + 2, end, buffer.shape[axis + 2] - end).fill_(float("nan"))

    def check(batch, members: list[int], lengths: list[int]) -> None:
        """Each row its sequence's states, zeros to the longest; the next token's logits as its sequence's alone."""
        end = max(lengths)
        for i, layer in enumerate(batch.layers):
            assert isinstance(layer, GrowingLayer) and layer.holds_views()
            assert layer.keys.shape[:3] == (len(members), 2, end)
            for row, (b, length) in enumerate(zip(members, lengths)):
                for mine, own in ((layer.keys, alone[b].layers[i].keys), (layer.values, alone[b].layers[i].values)):
                    assert torch.equal(mine[row, :, :length], own[0, :, :length]) and not mine[row, :, length:].any()
        token = torch.randint(0, 96, (len(members), 1), generator=g)
        allowed = torch.zeros(len(members), 1, 1, end + 1, dtype=torch.bool)
        for row, length in enumerate(lengths):
            allowed[row, 0, 0, :length], allowed[row, 0, 0, end] = True, True
        together = model(input_ids=token, position_ids=torch.tensor(lengths)[:, None], attention_mask=allowed,
                         **{cache_argument(model): batch}).logits
        caches.truncate(batch, end)
        for row, b in enumerate(members):
            own = model(input_ids=token[row:row + 1], position_ids=torch.tensor([[lengths[row]]]),
                        **{cache_argument(model): alone[b]}).logits
            caches.truncate(alone[b], lengths[row])
            assert torch.allclose(together[row], own[0], atol=1e-5)

    with torch.inference_mode():
        for ids, cache in zip(prompts, alone):
            model(input_ids=ids, **{cache_argument(model): cache})
        batch = stack_rows([(alone[0], [5]), (alone[1], [9])], rows_room=4)
        stores = [buffer.untyped_storage().data_ptr() for buffer, _ in buffers(batch)]
        check(batch, [0, 1], [5, 9])
        poison(batch, 4)
        assert stack_rows([(batch, [5, 9]), (alone[2], [7])], rows_room=4) is batch  # joined in place
        check(batch, [0, 1, 2], [5, 9, 7])
        select_rows(batch, [0, 2], [5, 7])  # the row of 9 leaves: the others move down, in place
        check(batch, [0, 2], [5, 7])
        poison(batch, 4)
        assert stack_rows([(batch, [5, 7]), (alone[3], [12]), (alone[1], [9])], rows_room=4) is batch  # longer now
        check(batch, [0, 2, 3, 1], [5, 7, 12, 9])
        assert [buffer.untyped_storage().data_ptr() for buffer, _ in buffers(batch)] == stores
        assert stack_rows([(batch, [5, 7, 12, 9]), (alone[0], [5])], rows_room=4) is not batch  # no room: a new one


def test_a_compiled_forward_over_growing_layers_has_no_graph_break():
    """A forward compiled with dynamic shapes (`compile_model(model, static=False)`) traces the growing
    layer's update as transformers' concatenation: one graph (fullgraph=True raises at a break), the
    same logits as eager."""
    import torch._dynamo

    model = tiny_model("llama", seed=8)
    compiled = torch.compile(model.forward, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    eager_cache, compiled_cache = new_cache(), new_cache()
    try:
        with torch.inference_mode():
            for length in (6, 1, 3):
                ids = torch.randint(0, 96, (1, length), generator=g)
                want = model(input_ids=ids, **{cache_argument(model): eager_cache}).logits
                got = compiled(input_ids=ids, **{cache_argument(model): compiled_cache}).logits
                assert torch.allclose(got, want, atol=1e-5)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("layers", [1, 8])
def test_compaction_moves_every_layer_in_one_shared_buffer(layers, monkeypatch):
    """After the first compaction a cache's layers keep their keys and values in one buffer (`shared_buffer`), so a
    compaction dispatches the same few ops (7) whatever the layer count; the layers outgrow it together, and what they
    hold equals what per-layer compaction leaves (the arena turned off)."""
    from opttree.counters import StepCounter
    from opttree.step import cache as module
    from opttree.step.cache import GrowingLayer, compact, shared_buffer

    monkeypatch.setattr(GrowingLayer, "HEADROOM", 4)
    g = torch.Generator().manual_seed(layers)
    mine, theirs = new_cache(), new_cache()
    states = [torch.randn(2, 1, 2, 6, 4, generator=g) for _ in range(layers)]  # (K/V, B, H, S, Dh) a layer
    steps = [[torch.randn(2, 1, 2, 5, 4, generator=g) for _ in range(layers)] for _ in range(12)]
    ops = []
    for cache, shared in ((mine, True), (theirs, False)):
        if not shared:
            monkeypatch.setattr(module, "shared_buffer", lambda cache: None)
        for i, kv in enumerate(states):
            cache.update(kv[0], kv[1], i)
        for step in steps:
            start = cache.get_seq_length()
            for i, kv in enumerate(step):
                cache.update(kv[0], kv[1], i)
            with StepCounter() as counter:
                compact(cache, start, torch.tensor([0, 2, 3]))
            if shared:
                ops.append(counter.ops)
                buffer = shared_buffer(cache)
                assert all(layer._store[0].data_ptr() == buffer[2 * i].data_ptr()
                           for i, layer in enumerate(cache.layers))
    assert mine.layers[0]._store[0].shape[2] > 6 + 4 + 5  # grown past the first buffer, all layers together
    assert max(ops[1:]) <= 8, ops  # after the first, which makes the buffer
    _same_cache(mine, theirs)


@pytest.mark.parametrize("cap", [None, 8000])
def test_a_shared_buffer_keeps_rows_leaving_and_a_cap_returns_layers_to_their_own(cap, monkeypatch):
    """A batch stacked into one shared buffer (`stack_rows`), rows leaving it (`select_rows`: moved down in place),
    compaction and growth: the same keys and values as layers with buffers of their own. With a cap on a CPU
    buffer's size (`CPU_SHARED_BYTES`) the layers leave the shared buffer when it would outgrow the cap, and
    compaction goes on layer by layer."""
    from opttree.step import cache as module
    from opttree.step.cache import GrowingLayer, compact_rows, select_rows, shared_buffer, stack_rows

    monkeypatch.setattr(GrowingLayer, "HEADROOM", 4)
    g = torch.Generator().manual_seed(0)
    parts = []
    for length in (5, 7, 6):
        cache = new_cache()
        for i in range(3):
            cache.update(torch.randn(1, 2, length, 4, generator=g), torch.randn(1, 2, length, 4, generator=g), i)
        parts.append((cache, [length]))
    steps = [[torch.randn(2, 3, 2, 4, 4, generator=g) for _ in range(3)] for _ in range(8)]  # (K/V, B, H, S, Dh)
    results = []
    for shared in (True, False):
        if cap is not None or not shared:
            monkeypatch.setattr(module, "CPU_SHARED_BYTES", cap if shared else 0)  # 0: no shared buffer at all
        cache = stack_rows(parts)
        assert (cache.layers[0]._arena is not None) == shared
        rows = [0, 1, 2]
        for step, kv in enumerate(steps):
            start = cache.get_seq_length()
            for i, (keys, values) in enumerate(kv):
                cache.update(keys[rows], values[rows], i)
            compact_rows(cache, [start] * len(rows), start, [torch.tensor([0, 2])] * len(rows))
            if step == 3:
                select_rows(cache, [0, 2], [start + 2] * 2)
                rows = [0, 2]
        results.append(cache)
        if shared:  # without a cap all layers grew together, in one buffer; with one, they left it
            assert cache.layers[0]._store[0].shape[2] > 7 + 4
            assert (shared_buffer(cache) is None) == (cap is not None)
    _same_cache(*results)
