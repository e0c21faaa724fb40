"""The shipped pair loads from inside the package and decodes exactly (fp32)."""

import json

import pytest
import torch
from helpers import hf_greedy

import opttree
from opttree.cli import main


@pytest.fixture
def reference_hardware(monkeypatch):
    """This machine seen as the one the shipped profile was measured on: the profile tests then hold on any
    CPU (on another kind of CPU the shipped profile is, rightly, not applied; see test_hardware)."""
    import opttree.profiles
    from opttree.profiles import SHIPPED_PROFILES

    measured_on = json.loads((SHIPPED_PROFILES / "bfloat16.json").read_text())["hardware"]
    monkeypatch.setattr(opttree.profiles, "hardware_key", lambda device="cpu": dict(measured_on))


def test_shipped_pair_is_exact_in_float32():
    target, draft, tokenizer = opttree.demo_models(dtype=torch.float32)
    assert target.get_output_embeddings().weight.shape[0] == draft.get_output_embeddings().weight.shape[0]
    ids = tokenizer("def add(a, b):\n", return_tensors="pt").input_ids
    out = opttree.generate(target, ids, draft, max_new_tokens=24)
    ref = hf_greedy(target, ids, 24, eos_token_id=tokenizer.eos_token_id)
    assert torch.equal(out.sequences, ref)
    assert out.stats.mean_accepted_length > 1.0


def test_the_shipped_target_ships_its_head():
    """drafter="head" with no head named uses the head shipped for the shipped target: exact, and it
    drafts (mean accepted length above 1); a head saved for it is found by its fingerprint only."""
    from opttree.parts import shipped_part

    target, _, tokenizer = opttree.demo_models(dtype=torch.float32)
    assert shipped_part("head", target) is not None and shipped_part("early_exit", target) is None
    ids = tokenizer("def add(a, b):\n", return_tensors="pt").input_ids
    out = opttree.generate(target, ids, drafter="head+lookup", max_new_tokens=24)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 24, eos_token_id=tokenizer.eos_token_id))
    assert out.stats.mean_accepted_length > 1.5


def test_demo_runs_and_reports_a_table(capsys):
    assert main(["demo", "--max-new-tokens", "12", "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    assert "accepted/step" in printed and "speedup" in printed and "3/3 completions identical" in printed
    assert "prompt mean" in printed and "weighs by its steps" in printed  # the summary says how it averages
    assert printed.count("identical to plain decoding ---") == 3  # each prompt's verdict


def test_demo_warns_when_the_machine_looked_disturbed(capsys, monkeypatch):
    from opttree.calibration import measure as calibrate

    monkeypatch.setattr(calibrate, "noise_problem", lambda before, after, run: f"a busy spell during {run} (test)")
    assert main(["demo", "--max-new-tokens", "6", "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    assert "WARNING: the machine looked disturbed during the demo (a busy spell during the demo (test))" in captured.err
    monkeypatch.setattr(calibrate, "noise_problem", lambda before, after, run: "")
    assert main(["demo", "--max-new-tokens", "6", "--dtype", "float32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["disturbed"] is None and report["dtype"] == "float32" and "drafter" in report


def test_demo_says_which_prompt_differs_and_where(capsys, monkeypatch):
    """A drafted output that differs from plain decoding (forced here) is named: prompt and token."""
    from opttree.cli import DEMO_PROMPTS
    from opttree.speculator import Speculator

    real = Speculator.generate
    second = opttree.demo_models()[2](DEMO_PROMPTS[1], return_tensors="pt").input_ids

    def altered(self, request, **kwargs):
        out = real(self, request, **kwargs)
        if self.options.get("tree") != "ar" and torch.equal(request.prompt, second):  # the second demo prompt only
            out.sequences = out.sequences.clone()  # an inference tensor: changed on a copy
            out.sequences[0, second.shape[1] + 2] += 1  # new token 2 changes
        return out

    monkeypatch.setattr(Speculator, "generate", altered)
    assert main(["demo", "--max-new-tokens", "6", "--dtype", "float32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical_to_ar"] == 2 and report["differences"] == [{"prompt": 2, "token": 2}]


def test_demo_cuts_runaway_completions():
    from opttree.cli import first_difference, shown_completion

    runaway = "def f():\n    \"\"\"Doc.\"\"\"\n" + "    #\n" * 50 + "    return 1"
    shown = shown_completion(runaway)
    assert shown.count("    #") == 1 and "[... the same line 49 more times]" in shown and shown.endswith("    return 1")
    long = "\n".join(f"line {i}" for i in range(30))
    shown = shown_completion(long, max_lines=12)
    assert shown.splitlines()[-1] == "[... 18 more lines]" and "line 11" in shown and "line 12" not in shown
    assert shown_completion("a\nb") == "a\nb"  # short ones are printed whole
    t = torch.tensor
    assert first_difference(t([1, 2, 3]), t([1, 2, 3])) is None
    assert first_difference(t([1, 2, 3]), t([1, 5, 3])) == 1
    assert first_difference(t([1, 2]), t([1, 2, 3])) == 2  # a shorter output differs where it ends


def test_shipped_pair_defaults_come_from_its_calibration_profile(reference_hardware):
    """No profile of this machine (conftest empties the cache): the reference machine's shipped profile
    sets budget, delta and draft temperature; flags given win; float32 has no profile (defaults)."""
    from opttree.cli import build_parser
    from opttree.flags import tree_options
    from opttree.profiles import SHIPPED_PROFILES, find_profile
    from opttree.settings import config

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


def test_profile_options_at_the_top_level(reference_hardware):
    """`opttree.profile_options` gives every calibrated setting of the shipped pair (its profile is
    for bfloat16), ready for generate()."""
    target, draft, tok = opttree.demo_models(torch.bfloat16)
    options = opttree.profile_options(target, draft)
    assert {"budget", "delta", "draft_temperature"} <= set(options)
    ids = tok("def add(a, b):\n", return_tensors="pt").input_ids
    out = opttree.generate(target, ids, draft, max_new_tokens=8, **options)
    assert out.stats.new_tokens == 8
    assert opttree.profile_options(target, None) == {}
