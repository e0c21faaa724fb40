"""A batch of prompts of different lengths in one generation: every row exactly what that prompt gives
alone (greedy: transformers' own generate; sampled: the same tokens as the prompt run alone with the
same seed), whatever else is in the batch."""

from __future__ import annotations

import pytest
import torch
from arch_configs import tiny
from helpers import hf_greedy

import opttree

NEW = 24
# the CI sweep's architectures that tree speculation drives (gemma3_text with windows of 16 positions:
# sliding layers whose masks a longer row's padding must not shift), sdpa and eager
ARCHS = [("llama", "sdpa", {}), ("gpt2", "eager", {}), ("gemma3_text", "sdpa", {"sliding_window": 16}),
         ("gemma3_text", "eager", {"sliding_window": 16}), ("phi3", "sdpa", {}), ("deepseek_v3", "sdpa", {})]
METHODS = [dict(), dict(drafter="recycling"), dict(drafter="lookup", budget=64), dict(tree="chain", budget=4),
           dict(tree="static"), dict(tree="ar"), dict(tree="sequoia", budget=8), dict(tree="eagle2"),
           dict(tree="dyspec")]
WITH_DRAFT = [dict(), dict(drafter="model+lookup"), dict(tree="chain"), dict(tree="dyspec", budget=8)]


def prompts(sizes, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # repeated stretches, so that the train-free sources find something to propose
    return [torch.randint(3, 24, (size,), generator=g).remainder(7 + size % 5) + 3 for size in sizes]


@pytest.fixture(scope="module", params=ARCHS, ids=lambda a: f"{a[0]}-{a[1]}")
def models(request):
    arch, attn, extra = request.param
    return tiny(arch, attn, seed=1, **extra), tiny(arch, attn, seed=2, **extra)


def check_rows(target, batch, outs, references: dict | None = None):
    """Each row equals its prompt's own greedy output; `references`: those already computed, by prompt
    (a test checks several methods against the same prompts of one target)."""
    outs = [outs] if len(batch) == 1 else outs  # a list of one prompt is that prompt
    assert isinstance(outs, list) and len(outs) == len(batch)
    references = {} if references is None else references
    for prompt, out in zip(batch, outs):
        key = tuple(prompt.tolist())
        if key not in references:
            references[key] = hf_greedy(target, prompt[None], NEW)
        ref = references[key]
        assert torch.equal(out.sequences, ref), (prompt.shape[0], out.new_tokens, ref[0, prompt.shape[0]:])
        assert out.stats.new_tokens == ref.shape[1] - prompt.shape[0]


@pytest.mark.parametrize("sizes", [[200], [3, 9], [5, 40, 3, 17, 120]], ids=lambda s: f"B{len(s)}")
def test_every_row_of_a_batch_is_its_prompts_own_greedy_output(models, sizes):
    target, draft = models
    batch, references = prompts(sizes, seed=len(sizes)), {}
    for method in METHODS:
        check_rows(target, batch, opttree.generate(target, batch, max_new_tokens=NEW, eos_token_id=[], **method),
                   references)
    for method in WITH_DRAFT:
        check_rows(target, batch, opttree.generate(target, batch, draft, max_new_tokens=NEW, eos_token_id=[],
                                                   **method), references)


def test_a_batch_of_sixteen(models):
    target, draft = models
    batch, references = prompts([3 + 13 * i for i in range(16)], seed=16), {}
    check_rows(target, batch, opttree.generate(target, batch, max_new_tokens=NEW, eos_token_id=[]), references)
    check_rows(target, batch, opttree.generate(target, batch, draft, max_new_tokens=NEW, eos_token_id=[]), references)


def test_prompts_of_very_different_lengths_run_as_batches_of_similar_ones(monkeypatch):
    """`generate` and `stream` with a list whose lengths do not share a batch well (`batch_sizing.fits`) run one
    batch per group of similar lengths, stepped in turn, and each row is still its prompt's own greedy output, in
    the order given."""
    import opttree.batch_sizing as batch_sizing
    from opttree.speculator import Speculator

    monkeypatch.setattr(batch_sizing, "LANE_POSITIONS", 16)  # small positions here: 120 beside 3 and 9 is "long"
    assert batch_sizing.length_lanes([120, 3, 9]) == [[1, 2], [0]]
    target, draft = tiny("llama", "sdpa", seed=1), tiny("llama", "sdpa", seed=2)
    batch = prompts([120, 3, 9], seed=5)
    batches = []
    original = Speculator._stream
    monkeypatch.setattr(Speculator, "_stream", lambda self, requests, *args: (batches.append(len(requests)),
                                                                              original(self, requests, *args))[1])
    references = {}
    for draft_model, method in [(None, dict()), (draft, dict(tree="chain"))]:
        batches.clear()
        check_rows(target, batch, opttree.generate(target, batch, draft_model, max_new_tokens=NEW, eos_token_id=[],
                                                   **method), references)
        assert batches == [2, 1]
    run = opttree.stream(target, batch, max_new_tokens=NEW, eos_token_id=[])
    order = [b for b, _ in run]  # (prompt index, chunk) pairs, as one batch's
    seen = {b: [] for b in range(3)}
    for b, chunk in opttree.stream(target, batch, max_new_tokens=NEW, eos_token_id=[]):
        seen[b].append(chunk)
    for b, prompt in enumerate(batch):
        assert torch.equal(torch.cat([prompt, *seen[b]]), references[tuple(prompt.tolist())][0])
        assert torch.equal(run.rows[b].committed, references[tuple(prompt.tolist())][0])
    assert sorted(order[:3]) == [0, 1, 2]  # each lane takes a step in turn: every row has a chunk after one round


def test_rows_that_end_early_leave_the_batch_and_the_others_go_on():
    target = tiny("llama", seed=1)
    batch = prompts([4, 30, 11], seed=3)
    alone = opttree.generate(target, batch[1], max_new_tokens=40, eos_token_id=[]).new_tokens.tolist()
    stop = alone[2]  # row 1 ends at its third token at the latest; the others may end there too
    run = opttree.stream(target, batch, max_new_tokens=40, eos_token_id=stop)
    seen = {b: [] for b in range(3)}
    for b, chunk in run:
        seen[b].append(chunk)
    for b, prompt in enumerate(batch):
        ref = hf_greedy(target, prompt[None], 40, eos_token_id=stop)
        assert torch.equal(torch.cat([prompt, *seen[b]]), ref[0])
        assert torch.equal(run.rows[b].committed, ref[0])
    assert run.rows[1].stats.new_tokens == alone.index(stop) + 1 <= 3


def test_a_padded_tensor_batch_with_its_attention_mask():
    """As transformers takes a batch: (B, T) left- or right-padded, the mask marking the prompt."""
    target = tiny("llama", seed=1)
    batch = prompts([6, 2, 9], seed=4)
    for side in ("left", "right"):
        width = max(p.shape[0] for p in batch)
        ids, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
        for b, prompt in enumerate(batch):
            span = slice(width - prompt.shape[0], width) if side == "left" else slice(0, prompt.shape[0])
            ids[b, span], mask[b, span] = prompt, 1
        check_rows(target, batch, opttree.generate(target, {"input_ids": ids, "attention_mask": mask},
                                                   max_new_tokens=NEW, eos_token_id=[]))
    holes = torch.ones(3, 9, dtype=torch.long)
    holes[0, 4] = 0
    with pytest.raises(ValueError, match="attention_mask row 0"):
        opttree.generate(target, {"input_ids": torch.ones(3, 9, dtype=torch.long), "attention_mask": holes})


@pytest.mark.parametrize("method", [dict(), dict(tree="sequoia", budget=8), dict(tree="opt", children="sampled"),
                                    dict(tree="opt", children="top", top_k=20, top_p=0.9)])
def test_a_sampled_row_is_the_same_whatever_else_is_in_the_batch(method):
    """Each row draws from its own generator, seeded with `seed`: alone or beside others, the same tokens.
    (Not with children sampled from the recycling matrix: it learns from every row and every generation,
    so such a row's draws depend on what it learned before; its distribution is exact all the same.)"""
    target, draft = tiny("llama", seed=1), tiny("llama", seed=2)
    batch = prompts([7, 3, 25, 12], seed=5)
    for d in (draft,) if method.get("children") == "sampled" else (None, draft):
        options = dict(max_new_tokens=NEW, temperature=1.0, eos_token_id=[], **method)
        together = opttree.generate(target, batch, d, seed=11, **options)
        for i, (prompt, out) in enumerate(zip(batch, together)):  # row i: seed + i
            assert torch.equal(out.sequences, opttree.generate(target, prompt, d, seed=11 + i, **options).sequences)


def test_a_batchs_rows_draw_independently_as_generates_do():
    """One prompt four times in one call (what generate's num_return_sequences hands custom_generate): four
    samples, each the prompt's own with seed + its row; a list of Requests keeps the seeds it names."""
    target = tiny("llama", seed=1)
    prompt = prompts([5], seed=2)[0]
    options = dict(max_new_tokens=NEW, temperature=1.0, eos_token_id=[])
    rows = [out.sequences for out in opttree.generate(target, prompt.expand(4, -1), seed=7, **options)]
    assert len({tuple(row[0].tolist()) for row in rows}) == 4
    for i, row in enumerate(rows):
        assert torch.equal(row, opttree.generate(target, prompt, seed=7 + i, **options).sequences)
    same = opttree.Speculator(target, **options).generate([opttree.Request(prompt, seed=3)] * 2)
    assert torch.equal(same[0].sequences, same[1].sequences)
    ours = target.generate(prompt[None], custom_generate=opttree.custom_generate, do_sample=True, seed=7,
                           num_return_sequences=4, max_new_tokens=NEW)  # generate's own top_k=50 where none is set
    expected = opttree.generate(target, prompt.expand(4, -1), seed=7, max_new_tokens=NEW, temperature=1.0, top_k=50)
    assert [row.tolist() for row in ours] == [out.sequences[0].tolist() for out in expected]
    assert len({tuple(row.tolist()) for row in ours}) == 4


def test_num_return_sequences_samples_each_prompt_that_many_times():
    """generate's argument (or the generation_config's): each prompt's copies in a row, as transformers orders them,
    copy i of a prompt drawn with seed + its row; refused where the copies could only be equal (greedy)."""
    target = tiny("llama", seed=1)
    batch = prompts([5, 9], seed=3)
    options = dict(max_new_tokens=NEW, temperature=1.0, eos_token_id=[])
    outs = opttree.generate(target, batch, num_return_sequences=3, seed=4, **options)
    assert len(outs) == 6 and len({tuple(out.sequences[0].tolist()) for out in outs}) == 6
    for row, out in enumerate(outs):
        alone = opttree.generate(target, batch[row // 3], seed=4 + row, **options)
        assert torch.equal(out.sequences, alone.sequences)
    saved = target.generation_config
    sampled_twice = {"num_return_sequences": 2, "do_sample": True}
    target.generation_config = saved.__class__.from_dict({**saved.to_dict(), **sampled_twice})
    try:
        one = opttree.generate(target, batch[0][None], seed=4, **options)  # (1, T): two copies of it
        assert [out.sequences.tolist() for out in one] == [out.sequences.tolist() for out in outs[:2]]
        ours = target.generate(batch[0][None], custom_generate=opttree.custom_generate, do_sample=True, seed=4,
                               top_k=0, max_new_tokens=NEW)  # transformers repeats the prompt: opttree does not again
        assert ours.shape[0] == 2
    finally:
        target.generation_config = saved
    with pytest.raises(ValueError, match="num_return_sequences=2 with greedy decoding"):
        opttree.generate(target, batch[0], num_return_sequences=2, max_new_tokens=NEW)
    with pytest.raises(ValueError, match="num_return_sequences must be an integer >= 1, got 0.5"):
        opttree.generate(target, batch[0], num_return_sequences=0.5, **options)
    with pytest.raises(ValueError, match="num_return_sequences must be an integer >= 1, got 0"):
        opttree.generate(target, batch[0], num_return_sequences=0, **options)


def test_a_list_of_one_prompt_is_that_prompt_and_a_list_of_requests_is_a_batch():
    target = tiny("llama", seed=1)
    prompt = prompts([5])[0]
    alone = opttree.generate(target, prompt[None], max_new_tokens=8)
    assert torch.equal(opttree.generate(target, [prompt.tolist()], max_new_tokens=8).sequences, alone.sequences)
    speculator = opttree.Speculator(target, max_new_tokens=8)
    (out,) = speculator.generate([opttree.Request(prompt)])
    assert torch.equal(out.sequences, alone.sequences)
    run = speculator.stream([opttree.Request(prompt)])
    assert all(b == 0 for b, _ in run)
    with pytest.raises(ValueError, match="per row"):
        run.stats


def test_a_speculator_checks_its_settings_once_and_each_request_keeps_its_own():
    target, draft = tiny("llama", seed=1), tiny("llama", seed=2)
    with pytest.raises(ValueError, match="budget must be"):
        opttree.Speculator(target, draft, budget=0)
    with pytest.raises(TypeError, match="unknown argument"):
        opttree.Speculator(target, draft, bugdet=8)
    speculator = opttree.Speculator(target, draft, budget=8, eos_token_id=[], max_new_tokens=40)
    batch = prompts([6, 19, 3], seed=8)
    requests = [opttree.Request(batch[0], max_new_tokens=5), opttree.Request(batch[1], temperature=0.8, seed=4),
                opttree.Request(batch[2], top_k=5, temperature=1.0, seed=9, max_new_tokens=30)]
    outs = speculator.generate(requests)
    for request, out in zip(requests, outs):
        alone = opttree.generate(target, request.prompt, draft, budget=8, eos_token_id=[],
                                 **{"max_new_tokens": 40, **request.settings()})
        assert torch.equal(out.sequences, alone.sequences)
    assert [out.stats.new_tokens for out in outs] == [5, 40, 30]
    with pytest.raises(ValueError, match="temperature must be"):
        speculator.generate(opttree.Request(batch[0], temperature=-1.0))
    with pytest.raises(TypeError, match="opttree.Request"):
        speculator.generate([batch[0]])
    # a request's own end-of-sequence ids: its draws up to the first of them, the others keep the speculator's
    stop = int(outs[1].new_tokens[3])
    own = speculator.generate([opttree.Request(batch[1], temperature=0.8, seed=4, eos_token_id=stop), requests[2]])
    first = outs[1].new_tokens.tolist().index(stop) + 1
    assert torch.equal(own[0].new_tokens, outs[1].new_tokens[:first])
    assert torch.equal(own[1].sequences, outs[2].sequences)


def test_what_decodes_one_sequence_at_a_time_is_refused_for_a_batch():
    target = tiny("llama", seed=1)
    batch = prompts([4, 6])
    with pytest.raises(NotImplementedError, match="static path"):
        opttree.generate(target, batch, static=True, max_new_tokens=4)
    with pytest.raises(ValueError, match="single prompt"):
        opttree.generate(target, batch, depth=object(), max_new_tokens=4)
    with pytest.raises(ValueError, match="must be in"):
        opttree.generate(target, [batch[0], torch.tensor([3, 500])], max_new_tokens=4)


def test_custom_generate_takes_a_padded_batch_as_generate_does():
    """target.generate(custom_generate=...) with a left-padded batch returns what transformers' own batched
    generate returns: the input rows, then each row's tokens, padded after the row's end."""
    from helpers import char_tokenizer

    target = tiny("llama", seed=1)
    tok = char_tokenizer()
    tok.padding_side = "left"
    enc = tok(["abcab", "xy", "pqrstpqrst"], return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=7)
    ours = target.generate(**enc, custom_generate=opttree.custom_generate, **kwargs)
    theirs = target.generate(**enc, **kwargs)
    assert torch.equal(ours, theirs)
    assert len(opttree.custom_generate.stats) == 3
    with pytest.raises(ValueError, match="MinLengthLogitsProcessor"):
        target.generate(**enc, custom_generate=opttree.custom_generate, min_length=14, **kwargs)


def test_requests_join_and_leave_a_running_batch_between_steps():
    """Continuous batching: requests admitted while the batch runs and one cancelled half-way; every row
    that runs to its end is its prompt's own greedy output, and the others are unharmed."""
    target, draft = tiny("llama", seed=1), tiny("llama", seed=2)
    speculator = opttree.Speculator(target, draft, budget=6, eos_token_id=[], max_new_tokens=NEW)
    first = prompts([9, 30], seed=21)
    later = prompts([4, 60, 17], seed=22)
    run = speculator.stream([opttree.Request(p) for p in first])
    chunks, admitted = {}, []
    for b, chunk in run:
        chunks.setdefault(b, []).append(chunk)
        seen = sum(len(c) for c in chunks.values())  # chunks so far: a new request every two
        if len(admitted) < len(later) and seen >= 2 * (len(admitted) + 1):
            admitted.append(speculator.admit(run, opttree.Request(later[len(admitted)])))
        if b == 1 and len(chunks[1]) == 2:
            run.cancel(1)  # row 1 leaves after its second chunk
    assert admitted == [2, 3, 4]
    everyone = first + later
    for b, prompt in enumerate(everyone):
        ref = hf_greedy(target, prompt[None], NEW)[0]
        got = torch.cat([prompt, *chunks[b]])
        if b == 1:
            assert torch.equal(got, ref[: got.shape[0]]) and got.shape[0] < ref.shape[0]
        else:
            assert torch.equal(got, ref), b
    with pytest.raises(ValueError, match="has ended"):
        speculator.admit(run, opttree.Request(later[0]))
    with pytest.raises(ValueError, match="does not admit"):
        speculator.admit(speculator.stream(opttree.Request(first[0])), opttree.Request(later[0]))


def test_one_node_budget_for_the_batch_keeps_every_row_exact(models):
    """batch_budget=N (batch-level OPT-Tree): the rows share N draft nodes a step, and each is still its
    prompt's own greedy output; a bad value is refused by name."""
    target, draft = models
    batch = prompts([5, 40, 3, 17], seed=4)
    for source in (dict(drafter="recycling+lookup"), dict(draft=draft)):
        outs = opttree.generate(target, batch, max_new_tokens=NEW, eos_token_id=[], budget=8, batch_budget=3,
                                **source)
        check_rows(target, batch, outs)
        steps = max(out.stats.steps for out in outs)
        assert sum(out.stats.drafted_tokens for out in outs) <= 3 * steps  # at most 3 nodes in every step
    with pytest.raises(TypeError, match="batch_budget"):
        opttree.generate(target, batch, batch_budget="auto")


def test_rows_with_a_draft_model_draft_together(monkeypatch):
    """The rows' draft forwards of a step run as one batched forward per round (`drafters.together`), and
    each row's tree and output are those it has alone; an error in that forward reaches the caller."""
    from opttree import engine
    from opttree.step.drafters import together

    target, draft = tiny("llama", seed=1), tiny("llama", seed=2)
    batch = prompts([7, 3, 25, 12], seed=6)
    sizes, run = [], together.forward_together
    monkeypatch.setattr(together, "forward_together", lambda forwards: (sizes.append(len(forwards)), run(forwards)))
    opttree.generate(target, batch, draft, max_new_tokens=NEW, eos_token_id=[])
    assert not sizes  # on a CPU each row drafts on its own (`engine.DRAFT_ALONE_ON`)
    monkeypatch.setattr(engine, "DRAFT_ALONE_ON", frozenset())  # together, as on a GPU
    for options in (dict(), dict(drafter="model+lookup"), dict(tree="dyspec", budget=8), dict(temperature=1.0, seed=3)):
        sizes.clear()
        outs = opttree.generate(target, batch, draft, max_new_tokens=NEW, eos_token_id=[], **options)
        assert sizes and max(sizes) == len(batch), (options, sizes)  # every row in one forward
        for i, (prompt, out) in enumerate(zip(batch, outs)):
            own = dict(options, seed=options["seed"] + i) if "seed" in options else options  # row i: seed + i
            alone = opttree.generate(target, prompt, draft, max_new_tokens=NEW, eos_token_id=[], **own)
            assert torch.equal(out.sequences, alone.sequences) and out.stats.steps == alone.stats.steps, options

    def broken(forwards):
        raise RuntimeError("a draft forward failed")

    monkeypatch.setattr(together, "forward_together", broken)
    with pytest.raises(RuntimeError, match="a draft forward failed"):
        opttree.generate(target, batch, draft, max_new_tokens=NEW, eos_token_id=[])


def test_a_batch_is_prefilled_in_one_forward_and_each_row_hears_its_own_prompt(tmp_path, monkeypatch):
    """The rows' prompts, right-padded to the longest, go through one forward: each row's drafter is seeded
    with its own prompt's logits (recycling) or hidden states (the head), and its last hidden state (the
    predictor's feature) is its own, as its prompt alone gives them; and every row stays exact."""
    from opttree.engine import prefill
    from opttree.step.cache import new_cache
    from opttree.step.drafters.head import FeatureHead, HeadDrafter, head_config
    from opttree.step.drafters.recycling import RecyclingDrafter
    from opttree.step.length import LengthPredictor

    for cls, hook in ((RecyclingDrafter, "seed"), (HeadDrafter, "seed_hidden")):
        original = getattr(cls, hook)

        def spy(self, *args, _original=original):  # what the prefill hands over, kept on the drafter
            self.heard = [a for a in (args[0] if isinstance(args[0], tuple) else args)]
            return _original(self, *args)

        monkeypatch.setattr(cls, hook, spy)
    target = tiny("llama", "sdpa", seed=1)
    torch.manual_seed(0)
    head = FeatureHead(head_config(target)).save(tmp_path / "head", target)
    predictor = LengthPredictor(target.config.hidden_size, 4).save(tmp_path / "length", target)
    batch = prompts([2, 37, 9, 1, 120], seed=31)  # a one-token prompt: nothing of it to prefill
    for method in (dict(drafter="recycling"), dict(drafter="head", head=head),
                   dict(drafter="recycling+lookup", depth_control="predictor", length_predictor=predictor)):
        speculator = opttree.Speculator(target, max_new_tokens=NEW, eos_token_id=[], **method)
        together = [speculator.row(opttree.Request(prompt)) for prompt in batch]
        prefill(target, new_cache(), together)
        for prompt, row in zip(batch, together):
            alone = speculator.row(opttree.Request(prompt))
            prefill(target, new_cache(), [alone])
            heard = [getattr(r.drafter.first, "heard", None) for r in (row, alone)]
            assert (heard[0] is None) == (heard[1] is None) == (prompt.shape[0] == 1), (method, prompt.shape)
            for ours, its in zip(*heard) if heard[0] else ():
                torch.testing.assert_close(ours, its)
            assert (row.feature is None) == (alone.feature is None)
            if row.feature is not None:
                torch.testing.assert_close(row.feature, alone.feature)
        assert sum(row.feature is not None for row in together) == (0 if method == dict(drafter="recycling") else 4)
        check_rows(target, batch, speculator.generate([opttree.Request(prompt) for prompt in batch]))


@pytest.mark.parametrize("drafter", [None, "draft", "recycling+lookup"])
def test_rows_of_one_prompt_prefill_it_once_and_each_draws_its_own(monkeypatch, drafter):
    """Rows that share a prompt (a prompt's num_return_sequences copies, a request's n choices) prefill it once, at
    the start and when they join a running batch (riding its step): the prefill's forward holds each distinct prompt
    once, every row gets its cache and logits (Token Recycling is seeded from them), and each row is what its seed
    gives alone."""
    from opttree.step import lean

    prefilled = []  # the rows of each prompt forward (a start's prefill, or a rider's)
    alone, forward = lean.Rider.alone, lean.LeanForward.forward
    monkeypatch.setattr(lean.Rider, "alone", lambda self, model, **k: (prefilled.append(self.input_ids.shape[0]),
                                                                        alone(self, model, **k))[1])
    monkeypatch.setattr(lean.LeanForward, "forward", lambda self, *a, **k: (
        prefilled.extend(r.input_ids.shape[0] for r in k.get("riders", ())), forward(self, *a, **k))[1])
    target, shipped_draft, tokenizer = opttree.demo_models(torch.float32)  # trained: its answers follow the prompt
    draft = shipped_draft if drafter == "draft" else None
    options = dict(max_new_tokens=NEW, temperature=1.0, eos_token_id=[], budget=4)
    options.update(drafter=drafter) if drafter not in (None, "draft") else None
    batch = [tokenizer(text, return_tensors="pt").input_ids[0]
             for text in ("def add(a, b):\n", "import os\nimport re\n", "import sys\nimport io\n")]  # 8, 6, 6 tokens
    outs = opttree.generate(target, batch[:2], draft, num_return_sequences=3, seed=4, **options)
    assert prefilled == [2]  # six rows, two prompts
    for row, out in enumerate(outs):
        own = opttree.generate(target, batch[row // 3], draft, seed=4 + row, **options)
        assert torch.equal(out.sequences, own.sequences), (drafter, row)
    prefilled.clear()
    speculator = opttree.Speculator(target, draft, **{k: v for k, v in options.items() if k != "max_new_tokens"},
                                    max_new_tokens=NEW)
    run = speculator.stream([opttree.Request(batch[0], max_new_tokens=2 * NEW, seed=1)])
    chunks = {b: list(chunk) for b, chunk in run.step()}
    joining = [opttree.Request(batch[p], seed=s) for p, s in ((1, 5), (2, 6), (1, 7))]
    assert run.admit_all([speculator.row(request) for request in joining]) == [1, 2, 3]
    while not run.ended:
        for b, chunk in run.step():
            chunks.setdefault(b, []).extend(chunk.tolist())
    assert prefilled == [1, 2]  # the first prompt, then the three rows' two prompts (one length: A, B, A) riding a step
    for b, request in enumerate(joining, start=1):
        own = opttree.generate(target, request.prompt, draft, seed=request.seed, **options)
        assert chunks[b] == own.new_tokens.tolist(), (drafter, b)


@pytest.mark.parametrize("ride", ["1", "0"])
def test_rows_admitted_together_share_one_prefill_and_a_failed_prefill_leaves_the_batch_as_it_was(monkeypatch, ride):
    """`Generation.admit_all`: arrivals join a running batch in one prefill forward per group of similar lengths
    (`engine.prefill_groups`) and decode exactly; if a prefill raises, none of them joins and the running rows go on
    unharmed. By default (`OPTTREE_RIDE`) those prefills ride the next step's forward, a rider a group
    (`lean.Rider`); with OPTTREE_RIDE=0 each is a forward of its own."""
    import opttree.engine as engine
    from opttree.step import lean

    monkeypatch.setenv("OPTTREE_RIDE", ride)
    rides = []  # riders of each lean forward
    forward = lean.LeanForward.forward
    monkeypatch.setattr(lean.LeanForward, "forward",
                        lambda self, *a, **k: (rides.append(len(k.get("riders", ()))), forward(self, *a, **k))[1])
    target = tiny("llama", seed=1)
    speculator = opttree.Speculator(target, budget=6, eos_token_id=[], max_new_tokens=NEW)
    first, later = prompts([9, 30], seed=41), prompts([15, 60, 17], seed=42)
    run = speculator.stream([opttree.Request(p) for p in first])
    chunks = {b: list(chunk) for b, chunk in run.step()}  # the first step (the first two rows' prefill with it)
    prefills = []
    original = engine.prefill
    monkeypatch.setattr(engine, "prefill", lambda t, c, rows, *more: (prefills.append(len(rows)),
                                                                      original(t, c, rows, *more))[1])
    broken = [speculator.row(opttree.Request(p)) for p in later]
    broken[1].drafter.start = lambda *a: (_ for _ in ()).throw(RuntimeError("prefill failed"))
    with pytest.raises(RuntimeError, match="prefill failed"):
        run.admit_all(broken)
    assert len(run.rows) == 2 and run.active == [0, 1]
    assert run.admit_all([speculator.row(opttree.Request(p)) for p in later]) == [2, 3, 4]
    # 15 and 17 tokens in one forward, 60 in one of its own: the failed try (60's prefill raised), then the admission
    assert prefills == ([2, 1, 2, 1] if ride == "0" else [])  # riding: the two groups' drafters started, none prefilled
    for b, chunk in run:
        chunks.setdefault(b, []).extend(chunk.tolist())
    assert max(rides) == (2 if ride == "1" else 0)  # the two groups rode one step's forward
    for b, prompt in enumerate(first + later):
        assert chunks[b] == hf_greedy(target, prompt[None], NEW)[0, prompt.shape[0]:].tolist(), b


@pytest.mark.parametrize("drafter", [None, "draft"])
def test_joining_prompts_ride_the_next_step_and_are_prefilled_alone_when_no_step_is_left(monkeypatch, drafter):
    """Riding prefills (`lean.Rider`): arrivals of 21 and 58 tokens (two groups) ride one step's forward together and
    then decode as their prompts' own greedy output; a request cancelled while waiting never rides; arrivals whose
    batch is cancelled whole before they ride are prefilled in forwards of their own, and decode exactly too."""
    import opttree.engine as engine
    from opttree.step import lean

    rides, alone = [], []
    forward = lean.LeanForward.forward
    monkeypatch.setattr(lean.LeanForward, "forward",
                        lambda self, *a, **k: (rides.append([r.input_ids.shape[1] for r in k.get("riders", ())]),
                                               forward(self, *a, **k))[1])
    boarded = []  # the riders of admitted rows (a prompt's own prefill runs `Rider.alone` too)
    boarding = engine.Generation._boarding
    monkeypatch.setattr(engine.Generation, "_boarding",
                        lambda self, new: (lambda groups: (boarded.extend(r for _, r in groups), groups)[1])(
                            boarding(self, new)))
    alone_of = lean.Rider.alone
    monkeypatch.setattr(lean.Rider, "alone", lambda self, model, **k: (
        alone.append(self.input_ids.shape) if any(self is r for r in boarded) else None, alone_of(self, model, **k))[1])
    target = tiny("llama", seed=1)
    draft = tiny("llama", seed=2) if drafter else None
    speculator = opttree.Speculator(target, draft, budget=4, eos_token_id=[], max_new_tokens=NEW)
    first, later = prompts([12, 9], seed=51), prompts([21, 58, 20], seed=52)

    def run_to_end(run, chunks):
        while not run.ended:
            for b, chunk in run.step():
                chunks.setdefault(b, []).extend(chunk.tolist())
        return chunks

    run = speculator.stream([opttree.Request(first[0], max_new_tokens=40)])
    chunks = {b: list(chunk) for b, chunk in run.step()}
    assert run.admit_all([speculator.row(opttree.Request(p)) for p in later[:2]]) == [1, 2]  # two groups
    assert run.admit(speculator.row(opttree.Request(later[2]))) == 3
    run.cancel(3)  # cancelled while waiting: it never rides
    run_to_end(run, chunks)
    assert [sizes for sizes in rides if sizes] == [[20, 57]] and not alone  # one step carried both groups
    assert 3 not in chunks and run.rows[3].finished
    # the running rows cancelled before the arrivals' step: no step is left to ride
    run = speculator.stream([opttree.Request(p) for p in first])
    tail = {b: list(chunk) for b, chunk in run.step()}
    assert run.admit_all([speculator.row(opttree.Request(p)) for p in later[:2]]) == [2, 3]
    run.cancel(0)
    run.cancel(1)
    run_to_end(run, tail)
    assert sorted(alone) == [(1, 20), (1, 57)], alone
    for got, want in ((chunks, {0: (first[0], 40), 1: (later[0], NEW), 2: (later[1], NEW)}),
                      (tail, {2: (later[0], NEW), 3: (later[1], NEW)})):
        for b, (prompt, new) in want.items():
            assert got[b] == hf_greedy(target, prompt[None], new)[0, prompt.shape[0]:].tolist(), b
