"""The whole settings space, drawn at random (hypothesis): every draw is exact (greedy: each row equal
to transformers' own greedy output) or refused up front with an error that names the setting; never a
crash from deep inside, never a silently different output."""

from __future__ import annotations

import pytest
import torch
from helpers import char_tokenizer, hf_greedy, tiny_model

import opttree
from opttree import batch_sizing

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

WINDOW = 160
NEW = 6
# words a refusal must use to name what it refuses
SETTING_WORDS = ("tree", "drafter", "budget", "batch_budget", "delta", "max_depth", "depth", "temperature", "top_p", "top_k", "seed",
                 "children", "depth_control", "stop", "context window", "draft", "head", "datastore", "source",
                 "prompt", "max_new_tokens", "samples its children", "distribution")


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", seed=1, max_positions=WINDOW)
    # a batch latency table for batch_budget="sized" (nothing is timed in the tests): 2-3 rows get 1 node each
    batch_sizing._MEASURED[batch_sizing.latency_path(target)] = batch_sizing.BatchLatency(
        {rows: [1.0 + rows * w for w in batch_sizing.WIDTHS] for rows in (1, 2, 4)})
    return target, tiny_model("llama", seed=2, layers=1, hidden=32, max_positions=WINDOW), char_tokenizer()


VALID_SOURCES = [None, "recycling", "lookup", "recycling+lookup", "model", "model+lookup"]
# one setting made invalid (or none): the refusal must name it
FAULTS = [None] * 12 + [("budget", 0), ("budget", -3), ("max_depth", 0), ("delta", 1.0),
          ("delta", -0.1), ("depth_control", "sideways"), ("temperature", -1.0), ("temperature", 1e-6),
          ("top_k", -2), ("top_p", 0.0), ("top_p", 1.5), ("drafter", "nonsense"), ("drafter", "model++lookup"),
          ("drafter", "head"), ("drafter", "datastore"), ("tree", "bushy"), ("lengths", [WINDOW]),
          ("batch_budget", "auto"), ("batch_budget", -1)]

draws = st.fixed_dictionaries({
    "tree": st.sampled_from(opttree.available_policies()),
    "drafter": st.sampled_from(VALID_SOURCES),
    "with_draft": st.booleans(),
    "budget": st.integers(1, 256),
    "max_depth": st.one_of(st.none(), st.integers(1, 16)),
    "delta": st.floats(0, 0.95),
    "depth_control": st.sampled_from(["delta", "fixed", "thompson"]),
    "temperature": st.sampled_from([0.0, 0.0, 0.7, 1.0]),
    "top_k": st.sampled_from([0, 0, 5]),
    "top_p": st.sampled_from([1.0, 1.0, 0.9]),
    "stop": st.sampled_from([None, None, ["%"], ["#$"]]),
    "batch_budget": st.sampled_from([None, None, "sized", "rows", 3]),
    "lengths": st.lists(st.one_of(st.integers(1, 40), st.integers(40, WINDOW - NEW)), min_size=1, max_size=3),
    "fault": st.sampled_from(FAULTS),
})


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(draw=draws)
def test_every_draw_of_the_settings_space_is_exact_or_refused_by_name(models, draw):
    target, draft, tok = models
    if draw["drafter"] is not None or draw["tree"] == "ar":  # a draft model exactly where its sources use it
        draw = {**draw, "with_draft": "model" in (draw["drafter"] or "")}
    if draw["tree"] == "ar":
        draw = {**draw, "drafter": None}
    if draw["fault"] is not None:
        draw = {**draw, draw["fault"][0]: draw["fault"][1]}
    g = torch.Generator().manual_seed(sum(draw["lengths"]))
    prompts = [torch.randint(3, 96, (n,), generator=g) for n in draw["lengths"]]
    options = {k: draw[k] for k in ("tree", "drafter", "budget", "max_depth", "delta", "depth_control", "temperature",
                                    "top_k", "top_p", "batch_budget")}
    try:
        outs = opttree.generate(target, prompts, draft if draw["with_draft"] else None, max_new_tokens=NEW,
                                eos_token_id=[], stop=draw["stop"], tokenizer=tok, **options)
    except (ValueError, NotImplementedError, TypeError) as error:
        message = str(error)
        assert any(word in message for word in SETTING_WORDS), f"a refusal that names no setting: {message}"
        return
    outs = outs if isinstance(outs, list) else [outs]
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs):
        assert out.sequences.shape[1] <= prompt.shape[0] + NEW
        assert int(out.sequences.min()) >= 0 and int(out.sequences.max()) < 96
        if draw["temperature"] == 0:
            stop = {} if draw["stop"] is None else {"stop_strings": draw["stop"], "tokenizer": tok}
            assert torch.equal(out.sequences, hf_greedy(target, prompt[None], NEW, **stop)), draw
