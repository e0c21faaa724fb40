"""The shipped pair loads from inside the package and decodes exactly (fp32)."""

import json

import torch
from helpers import hf_greedy

import opttree
from opttree.cli import main


def test_shipped_pair_is_exact_in_float32():
    target, draft, tokenizer = opttree.demo_models(dtype=torch.float32)
    assert target.get_output_embeddings().weight.shape[0] == draft.get_output_embeddings().weight.shape[0]
    ids = tokenizer("def add(a, b):\n", return_tensors="pt").input_ids
    out = opttree.generate(target, ids, draft, max_new_tokens=24)
    ref = hf_greedy(target, ids, 24, eos_token_id=tokenizer.eos_token_id)
    assert torch.equal(out.sequences, ref)
    assert out.stats.mean_accepted_length > 1.0


def test_demo_runs_and_reports_a_table(capsys):
    assert main(["demo", "--max-new-tokens", "12", "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert "accepted/step" in printed and "speedup" in printed and "3/3 completions identical" in printed


def test_shipped_pair_defaults_come_from_its_calibration_profile():
    """No profile of this machine (conftest empties the cache): the reference machine's shipped profile
    sets budget, delta and draft temperature; flags given win; float32 has no profile (defaults)."""
    from opttree import config
    from opttree.bench.calibrate import SHIPPED_PROFILES, find_profile
    from opttree.cli import build_parser, tree_options

    target, draft, _ = opttree.demo_models(dtype=torch.bfloat16)
    assert find_profile(target, draft) == SHIPPED_PROFILES / "bfloat16.json"
    profile = json.loads((SHIPPED_PROFILES / "bfloat16.json").read_text())
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    options = tree_options(args, target, draft)
    assert (options["budget"], options["delta"]) == (profile["recommended"]["budget"], profile["recommended"]["delta"])
    assert options["draft_temperature"] == profile["draft_temperature"]["greedy"] < 1
    args = build_parser().parse_args(["generate", "--prompt", "x", "--budget", "16", "--draft-temperature", "1"])
    explicit = tree_options(args, target, draft)  # a budget given: delta falls back to the default
    assert (explicit["budget"], explicit["delta"], explicit["draft_temperature"]) == (16, config.DEFAULT_DELTA, 1.0)
    fp32 = opttree.demo_models(dtype=torch.float32)
    assert find_profile(fp32[0], fp32[1]) is None
    options = tree_options(build_parser().parse_args(["generate", "--prompt", "x"]), fp32[0], fp32[1])
    assert (options["budget"], options["delta"], options["draft_temperature"]) == (
        config.DEFAULT_BUDGET, config.DEFAULT_DELTA, 1.0)


def test_profile_options_at_the_top_level():
    """`opttree.profile_options` gives every calibrated setting of the shipped pair (its profile is
    for bfloat16), ready for generate()."""
    target, draft, tok = opttree.demo_models(torch.bfloat16)
    options = opttree.profile_options(target, draft)
    assert {"budget", "delta", "draft_temperature"} <= set(options)
    ids = tok("def add(a, b):\n", return_tensors="pt").input_ids
    out = opttree.generate(target, ids, draft, max_new_tokens=8, **options)
    assert out.stats.new_tokens == 8
    assert opttree.profile_options(target, None) == {}
