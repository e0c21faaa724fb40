"""transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name deprecated with a
FutureWarning, the outputs' field too): opttree passes each model's cache by the name its forward takes
(`opttree.step.cache.cache_argument`), on either side of the rename, and never uses the deprecated name."""

import inspect
import warnings
from contextlib import contextmanager

import pytest
import torch
from helpers import hf_greedy, tiny_model
from transformers.utils import generic

import opttree
import opttree.certify
from opttree.bench.methods import count_forwards
from opttree.calibration.measure import latency_curves, probe_ms
from opttree.hardware import forward_ms
from opttree.step.cache import cache_argument
from opttree.step.drafters.early_exit import ExitLayer
from opttree.step.drafters.head import FeatureHead, head_config
from opttree.train.cli import one_token_latency_ms

PROMPT = torch.tensor([[1, 5, 7, 9, 11, 13]])


@contextmanager
def deprecated_cache_name_is_an_error():
    """Passing `past_key_values=` to a forward that takes `cache` (its FutureWarning), or reading an
    output's `.past_key_values` (transformers' notice), raises instead of warning."""

    def refuse(message, *args, **kwargs):
        if "past_key_values" in str(message):
            raise AssertionError(f"the deprecated cache name was used: {message}")

    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.filterwarnings("error", message=".*past_key_values", category=FutureWarning)
        patch.setattr(generic.logger, "warning_once", refuse)
        patch.setattr(opttree.certify, "_certified", {})  # the exactness probe runs again, under the check
        yield


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_the_cache_argument_is_the_one_the_forward_takes(arch):
    model = tiny_model(arch)
    params = inspect.signature(type(model).forward).parameters
    assert cache_argument(model) in params
    assert cache_argument(model) == ("cache" if "cache" in params else "past_key_values")


def test_no_call_of_ours_passes_the_deprecated_name(tmp_path):
    target, draft = tiny_model(seed=0), tiny_model(seed=1, hidden=32, layers=1)
    reference = hf_greedy(target, PROMPT, 16)
    torch.manual_seed(0)
    head = FeatureHead(head_config(target)).save(tmp_path / "head", target)
    early_exit = ExitLayer(target, 1).save(tmp_path / "exit", target)
    ids = torch.arange(3, 19)
    with deprecated_cache_name_is_an_error():
        for static in (False, True):
            out = opttree.generate(target, PROMPT, draft, budget=6, max_new_tokens=16, eos_token_id=[], static=static)
            assert torch.equal(out.sequences, reference), static
        for drafter, part in (("head", {"head": head}), ("early-exit", {"early_exit": early_exit})):
            out = opttree.generate(target, PROMPT, drafter=drafter, budget=6, max_new_tokens=16, eos_token_id=[],
                                   **part)
            assert torch.equal(out.sequences, reference), drafter
        opttree.generate(target, PROMPT, draft, budget=6, max_new_tokens=8, temperature=0.8, seed=0)
        with count_forwards(target) as cache_lens:
            ours = target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), assistant_model=draft,
                                   custom_generate=opttree.custom_generate, do_sample=False, max_new_tokens=16,
                                   eos_token_id=None, pad_token_id=0, budget=6)
        assert torch.equal(ours, reference)
        assert cache_lens[0] == 0 and max(cache_lens) > PROMPT.shape[1]  # the hook sees the cache by its name
        forward_ms(target, 2, context=8, repeats=1)
        latency_curves({"target": target}, ids, 2, repeats=1)
        probe_ms(target, ids, repeats=1)
        one_token_latency_ms(target, torch.float32, prefix=8, repeats=1)
