"""Benchmark harness and calibration on tiny models: prompt formats, results schema, mismatch check,
profile round trip, and the `bench` / `calibrate` commands end to end."""

import argparse
import json

import pytest
import torch
from helpers import tiny_model

import opttree
from opttree import profiles
from opttree.bench import methods as bench_methods
from opttree.bench import report
from opttree.bench.cli import parse_budgets, profile_defaults
from opttree.bench.methods import Method, MethodSpec, Run, Settings, emitted_per_step, expand_methods
from opttree.bench.prompts import Prompt, encode, load_prompts
from opttree.bench.runner import first_difference, prepare, run_bench
from opttree.calibration import estimate, measure
from opttree.calibration import report as cal_report
from opttree.calibration import run as cal_run
from opttree.cli import main
from opttree.hardware import machine_info, now
from opttree.settings.config import DEFAULT_DELTA
from opttree.settings.drafter_spec import DrafterSpec
from opttree.speculator import Speculator

VOCAB = 96


def split_char_tokenizer():
    """One token per character (ids 3..), so prompts are several tokens long; 0 pad, 1 bos, 2 eos."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 32 + VOCAB - 3)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {ch: i + 3 for i, ch in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def near_draft(seed: int = 1, noise: float = 0.1):
    """The target of that seed with a perturbed output head: a draft that often, not always, agrees."""
    draft = tiny_model("llama", seed=seed)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        draft.lm_head.weight += noise * torch.randn(draft.lm_head.weight.shape, generator=generator)
    return draft


@pytest.fixture(scope="module")
def pair():
    return tiny_model("llama", seed=1), near_draft()


@pytest.fixture(scope="module")
def cases(pair):
    tok = split_char_tokenizer()
    prompts = [Prompt("p1", "code", "def f(x):"), Prompt("p2", "code", "abcabc"), Prompt("q1", "prose", "Hello")]
    ready, skipped = prepare(prompts, lambda p: encode(tok, p), pair[0], max_new_tokens=12)
    assert not skipped
    return ready


# ---- prompts -------------------------------------------------------------------------------------


def test_prompt_formats(tmp_path):
    spec = tmp_path / "spec.jsonl"
    spec.write_text(
        json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}) + "\n\n"
        + json.dumps({"question_id": 82, "category": "math", "turns": ["2+2?"]}) + "\n"
        + json.dumps({"question_id": 83, "category": "writing", "turns": ["Write a song."]}) + "\n"
    )
    assert load_prompts(spec) == [Prompt("81", "writing", "Write a poem.", chat=True),
                                  Prompt("82", "math", "2+2?", chat=True), Prompt("83", "writing", "Write a song.", chat=True)]
    assert [p.id for p in load_prompts(spec, categories=["writing"])] == ["81", "83"]
    assert [p.id for p in load_prompts(spec, per_category=1)] == ["81", "82"]
    assert [p.id for p in load_prompts(spec, limit=2)] == ["81", "82"]

    humaneval = tmp_path / "humaneval.jsonl"
    humaneval.write_text(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n", "test": "..."}) + "\n")
    assert load_prompts(humaneval) == [Prompt("HumanEval/0", "humaneval", "def f():\n", chat=False)]

    text = tmp_path / "mine.txt"
    text.write_text("first prompt\n\n  \nsecond prompt\n")
    assert load_prompts(text) == [Prompt("mine:1", "mine", "first prompt"), Prompt("mine:4", "mine", "second prompt")]


def test_prompt_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        load_prompts(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*'turns'.*'prompt'"):
        load_prompts(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not a JSON object"):
        load_prompts(bad)
    good = tmp_path / "ok.jsonl"
    good.write_text(json.dumps({"category": "qa", "turns": ["?"]}) + "\n")
    with pytest.raises(ValueError, match=r"unknown categories \['math'\]; the prompt file has: qa"):
        load_prompts(good, categories=["math"])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(empty)


def test_chat_turns_use_the_chat_template_when_there_is_one():
    tok = split_char_tokenizer()
    plain = encode(tok, Prompt("1", "qa", "Hi", chat=True))
    assert tok.decode(plain[0]) == "Hi"
    tok.chat_template = "{% for m in messages %}U:{{ m['content'] }}{% endfor %}A:"
    assert tok.decode(encode(tok, Prompt("1", "qa", "Hi", chat=True))[0]) == "U:HiA:"
    assert tok.decode(encode(tok, Prompt("1", "code", "Hi", chat=False))[0]) == "Hi"  # continued as is


# ---- methods and records -------------------------------------------------------------------------


def test_method_expansion_and_errors():
    specs = expand_methods(["opt", "hf-lookup", "chain"], [(4, None), (8, 0.3)])
    assert [s.label for s in specs] == ["ar", "opt@4", "opt@8/d0.3", "hf-lookup", "chain@4", "chain@8/d0.3"]
    with pytest.raises(ValueError, match=r"unknown method 'eagle9'; available: .*opt.*hf-assisted.*POLICY:DRAFTER"):
        expand_methods(["eagle9"], [(4, None)])
    with pytest.raises(ValueError, match="unknown draft source 'magic'"):
        expand_methods(["opt:magic"], [(4, None)])
    with pytest.raises(ValueError, match="unknown method 'hf-lookup:recycling'"):
        expand_methods(["hf-lookup:recycling"], [(4, None)])
    sourced = expand_methods(["opt:recycling+lookup"], [(4, None)])
    assert [s.label for s in sourced] == ["ar", "opt:recycling+lookup@4"]
    with pytest.raises(ValueError, match="need at least one budget"):
        expand_methods(["opt"], [])
    for bad in ("4,x", "0", "4,-2", ""):
        with pytest.raises(ValueError, match="--budgets"):
            parse_budgets(bad, 0.2, None, None)


def test_hf_steps_from_cache_lengths():
    # prompt 12 tokens; forwards saw caches 0, 12, 14, 15; final length 18: emitted 1, 2, 1, 2 (bonus included)
    assert emitted_per_step([0, 12, 14, 15], 12, 18) == [1, 2, 1, 2]
    assert emitted_per_step([0, 12, 12], 12, 14) is None  # inconsistent: no step can emit nothing
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 9, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def check_summary_schema(summary, labels, categories):
    for row in summary:
        assert set(report.SUMMARY_KEYS) <= set(row)
    assert [r["category"] for r in summary] == [c for c in ["all"] + categories for _ in labels]
    assert [r["label"] for r in summary] == labels * (len(categories) + 1)


def test_results_schema_and_exactness(pair, cases, tmp_path):
    target, draft = pair
    names = ["opt", "chain", "hf-assisted", "hf-lookup", "hf-ar"]
    specs = expand_methods(names, [(2, None), (4, None)])
    settings = Settings(max_new_tokens=12, eos_token_id=2)
    records = run_bench(target, draft, cases, specs, settings, repeats=2, progress=False)
    labels = [s.label for s in specs]
    assert len(records) == 2 * len(cases) * len(specs)
    for r in records:
        assert r["new_tokens"] == len(r["token_ids"]) and r["time_s"] > 0 and r["steps"] >= 1
        assert sum(r["accepted_histogram"]) == r["steps"]
        assert r["mismatch"] is False and r["first_mismatch"] is None  # float32, temperature 0: exact
    summary = report.summarize(records)
    check_summary_schema(summary, labels, ["code", "prose"])
    by_label = {r["label"]: r for r in summary if r["category"] == "all"}
    assert by_label["ar"]["speedup"] == pytest.approx(1.0) and by_label["ar"]["mean_accepted_length"] == 1.0
    assert by_label["hf-ar"]["mean_accepted_length"] == 1.0
    assert by_label["opt@4"]["mean_accepted_length"] > 1.3
    assert by_label["opt@4"]["prompts"] == 3 and by_label["opt@4"]["mismatches"] == 0
    ar_rate = report.rate([r for r in records if r["label"] == "ar"])
    assert by_label["opt@2"]["speedup"] == pytest.approx(by_label["opt@2"]["tokens_per_second"] / ar_rate)

    results = {"meta": meta(), "prompts": [], "skipped": [], "records": records, "summary": summary}
    paths = report.write(results, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["summary"] == json.loads(json.dumps(summary))
    text = paths["markdown"].read_text()
    assert "## all" in text and "## code" in text and "## prose" in text and "| opt | 4 | 3 |" in text
    for name in ("mal_vs_budget", "speedup_vs_budget", "accepted_histogram"):
        assert paths[name].read_bytes()[:4] == b"\x89PNG"


def test_the_compiled_peer_is_exact_and_compiles_in_the_warm_up(pair, cases):
    """hf-compiled: transformers' static cache and torch.compile, compiled before the timed runs; every
    method's warm-up time and host costs are recorded."""
    target, draft = pair
    specs = expand_methods(["hf-compiled", "opt"], [(4, None)])
    records = run_bench(target, draft, cases[:2], specs, Settings(max_new_tokens=12, eos_token_id=2), progress=False)
    assert all(r["mismatch"] is False for r in records)
    for r in records:
        assert r["warmup_s"] > 0 and r["host_syncs_per_step"] >= 0 and r["ops_per_step"] > 0
    compiled = [r for r in records if r["label"] == "hf-compiled"]
    assert compiled[0]["warmup_s"] > 5 * max(r["time_s"] for r in compiled)  # the compilation happened there


def test_the_warm_up_compiles_every_bucket_the_timed_runs_use():
    """With a compiled target the static path's step compiles once per budget and capacity bucket, and a
    tree widens the bucket (a 150-token prompt, 60 new tokens and a 60-node tree need 270 positions: the
    512 bucket, where the generation alone fits 256): the warm-up compiles it, no timed run does."""
    import torch._dynamo

    from opttree.bench.runner import Case, build_runners, warm_up

    target = tiny_model("llama", seed=1, layers=1, hidden=32)
    opttree.compile_model(target)
    cases = [Case(Prompt("long", "code", "x"), torch.arange(150)[None] % 90 + 3)]
    specs = expand_methods(["opt:recycling"], [(60, None)])
    settings = Settings(max_new_tokens=60, eos_token_id=-1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    warm_up(target, None, specs, settings, cases)
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for runner in build_runners(target, None, specs, settings).values():
        runner(cases[0].ids)
    assert compiled >= 1 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled


def meta(temperature=0.0):
    return {"command": "opttree bench ...", "date": now(), "machine": machine_info(), "target": "t",
            "draft": "d", "dtype": "float32", "prompt_file": "p", "prompts": 3, "repeats": 1,
            "settings": vars(Settings(max_new_tokens=12, temperature=temperature))}


def corrupting_method(target, draft, settings, spec):
    """Plain decoding whose third new token is replaced: a wrong method the harness must catch."""
    ar = bench_methods.tree_method(target, draft, settings, MethodSpec("ar"))

    def run(prompt_ids):
        out = ar(prompt_ids)
        tokens = list(out.token_ids)
        tokens[2] = (tokens[2] + 1) % VOCAB
        return Run(tokens, out.steps, out.accepted_histogram, out.time_s)

    return run


def test_a_wrong_method_is_reported_as_a_mismatch(pair, cases, monkeypatch):
    monkeypatch.setitem(bench_methods.PEERS, "corrupt", Method(corrupting_method, False, False, "test only"))
    specs = expand_methods(["opt", "corrupt"], [(4, None)])
    records = run_bench(*pair, cases, specs, Settings(max_new_tokens=12, eos_token_id=None), progress=False)
    wrong = [r for r in records if r["method"] == "corrupt"]
    assert [r["mismatch"] for r in wrong] == [True] * len(cases)
    assert [r["first_mismatch"] for r in wrong] == [2] * len(cases)
    summary = report.summarize(records)
    rows = {(r["label"], r["category"]): r["mismatches"] for r in summary}
    assert rows[("corrupt", "all")] == 3 and rows[("corrupt", "code")] == 2 and rows[("opt@4", "all")] == 0
    text = report.markdown({"meta": meta(), "skipped": [], "summary": summary})
    assert "outputs differing from `ar` (temperature 0): **3** runs" in text


def test_sampling_runs_are_not_compared(pair, cases):
    specs = expand_methods(["opt"], [(4, None)])
    records = run_bench(*pair, cases[:1], specs, Settings(max_new_tokens=8, temperature=0.8, eos_token_id=None),
                        progress=False)
    assert all(r["mismatch"] is None for r in records)
    assert all(r["mismatches"] is None for r in report.summarize(records))


def test_slow_runs_are_flagged_not_dropped():
    runs = [{"label": "ar", "prompt_id": str(i), "repeat": 0, "new_tokens": 10, "time_s": 0.1} for i in range(5)]
    runs[3]["time_s"] = 2.0  # 20x the median: someone else used the machine
    assert [(r["prompt_id"], round(r["times_median"])) for r in report.slow_runs(runs)] == [("3", 20)]
    text = report.markdown({"meta": meta(), "skipped": [], "summary": [], "slow_runs": report.slow_runs(runs)})
    assert "1 runs took over 5x their method's median time per token" in text


def test_prompts_too_long_for_the_context_are_skipped(pair):
    tok = split_char_tokenizer()
    small = tiny_model("llama", seed=1, max_positions=16)
    ready, skipped = prepare([Prompt("a", "x", "short"), Prompt("b", "x", "far too long a prompt")],
                             lambda p: encode(tok, p), small, max_new_tokens=8)
    assert [c.prompt.id for c in ready] == ["a"] and skipped[0]["prompt_id"] == "b"


# ---- calibration ---------------------------------------------------------------------------------


def test_calibrate_profile_is_read_by_auto_settings(pair, cases, tmp_path, monkeypatch):
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path / "cache"))
    target, draft = pair
    with pytest.raises(ValueError, match="run `opttree calibrate`"):
        profiles.auto_settings(target, draft)
    profile = cal_run.run_calibration(target, draft, [c.ids for c in cases[:2]], budgets=[1, 3], deltas=[0.2, 0.5],
                            max_tokens=5, context=20, repeats=2, max_new_tokens=8, progress=False)
    assert len(profile["latency"]["target_s"]) == 5 and min(profile["latency"]["draft_s"]) > 0
    assert len(profile["grid"]) == 4
    rec = profile["recommended"]
    assert (rec["budget"], rec["delta"]) in {(r["budget"], r["delta"]) for r in profile["grid"]}
    assert rec["fraction_of_best_measured"] >= estimate.CONFIRM
    paths = cal_report.write(profile, tmp_path / "out")
    assert paths["cached_profile"] == profiles.profile_path(target, draft)
    assert json.loads(paths["profile"].read_text())["recommended"] == json.loads(json.dumps(rec))
    assert paths["latency_plot"].read_bytes()[:4] == b"\x89PNG"
    assert "recommended: budget" in paths["markdown"].read_text()
    assert "Is the draft's p-hat calibrated" in paths["markdown"].read_text()
    assert profile["estimate_over_measured"] > 0
    assert len(profile["noise"]["probe_ms_before"]) == measure.NOISE_REPEATS and "problem" in profile["noise"]
    assert profiles.auto_settings(target, draft) == (rec["budget"], rec["delta"])
    runs = [(r["drafter"], r["budget"]) for r in profile["drafters"]]
    assert runs == measure.drafter_runs(rec["budget"], 6) and [d for d, _ in runs[:3]] == list(measure.DRAFTERS)
    fastest = max(profile["drafters"], key=lambda r: r["measured_speedup"])
    assert rec["tree"] == "ar" or (rec["drafter"], rec["drafter_budget"]) == (fastest["drafter"], fastest["budget"])
    for row in profile["drafters"]:  # the draft model's sources at its delta, the train-free ones at theirs
        assert row["delta"] == (rec["delta"] if "model" in row["drafter"] else DEFAULT_DELTA)
    if rec["tree"] == "opt":  # the chosen sources come with the budget (and delta) they were measured at
        chosen = DrafterSpec.parse(rec["drafter"])
        measured = next(r for r in profile["drafters"] if (r["drafter"], r["budget"]) == (rec["drafter"],
                                                                                          rec["drafter_budget"]))
        assert profiles.auto_settings(target, draft, chosen) == (rec["drafter_budget"], measured["delta"])
        with_model = "model" in rec["drafter"].split("+")  # else profile_options gives the draft model's settings
        assert profiles.calibrated_options(target, draft)["budget"] == rec["drafter_budget" if with_model else "budget"]
    assert "## Draft sources at the recommended budget" in paths["markdown"].read_text()
    # sampling measured apart: its own choice (never slower than plain decoding), read back for temperature > 0
    sampled = profile[profiles.SAMPLED_FIELD]
    assert [(r["drafter"], r["budget"], r["tree"]) for r in profile["drafters_sampled"]] == measure.sampled_runs(rec["budget"])
    fastest = max(profile["drafters_sampled"], key=lambda r: r["measured_tokens_per_second"])
    if fastest["measured_speedup"] >= 1:
        assert (sampled["tree"], sampled["drafter"], sampled["drafter_budget"]) == \
            (fastest["tree"], fastest["drafter"], fastest["budget"])
    else:
        assert sampled["tree"] == "ar"
    assert profiles.profile_sources(target, draft, 1.0) == {k: sampled[k] for k in ("tree", "drafter", "why")}
    assert profiles.profile_sources(target, draft, 0.0)["tree"] == rec["tree"]
    if sampled["tree"] != "ar":
        chosen = DrafterSpec.parse(sampled["drafter"])
        assert profiles.auto_settings(target, draft, chosen, 0.7) == \
            (sampled["drafter_budget"], rec["delta"] if chosen.uses_draft_model else DEFAULT_DELTA)
    assert "## Sampling (temperature 1)" in paths["markdown"].read_text()
    fitted = profile[profiles.DRAFT_TEMPERATURE_FIELD]
    assert set(fitted) == {"greedy", "sampled"} and all(0 < t < 100 for t in fitted.values())
    assert rec["draft_temperature"] == fitted["greedy"]  # the grid ran at the calibration temperature, 0
    assert profiles.profile_options(target, draft, "opt", 0.0) == {"draft_temperature": fitted["greedy"]}
    sequoia_options = profiles.profile_options(target, draft, "sequoia", 1.0)
    assert sequoia_options["draft_temperature"] == fitted["sampled"] and len(sequoia_options["acceptance"]) == 8
    stale = dict(json.loads(paths["cached_profile"].read_text()), version=profiles.PROFILE_VERSION - 1)
    paths["cached_profile"].write_text(json.dumps(stale))  # written by an older opttree
    with pytest.warns(UserWarning, match="run `opttree calibrate` again"):
        assert profiles.find_profile(target, draft) is None
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no calibration profile"):
        profiles.auto_settings(target, draft)
    other = tiny_model("llama", seed=1, layers=1, hidden=32)
    with pytest.raises(ValueError, match="no calibration profile"):
        profiles.auto_settings(target, other)  # another pair: its own profile


def test_noise_check_flags_a_changed_load_or_unsteady_timings():
    steady = [10.0, 10.1, 9.9, 10.0, 10.2, 9.8, 10.0, 10.1, 9.9]
    assert measure.noise_problem(steady, [t * 1.1 for t in steady]) == ""
    assert "load changed" in measure.noise_problem(steady, [t * 3 for t in steady])  # a busy spell began mid-run
    unsteady = [10.0, 30.0, 9.0, 25.0, 10.0, 40.0, 9.5, 28.0, 10.0]
    assert "spread" in measure.noise_problem(unsteady, unsteady)


def test_disagreement_between_latency_model_and_measurement_is_reported():
    assert cal_report.consistency_note({"estimate_over_measured": 1.2}) == ""
    assert "run `opttree calibrate` again on an idle machine" in cal_report.consistency_note({"estimate_over_measured": 0.03})


def test_draft_sources_are_chosen_by_measurement_and_never_slower_than_plain_decoding():
    assert measure.drafter_runs(8, 16) == [("model", 8), ("model+lookup", 8), ("recycling+lookup", 8),
                                       ("recycling+lookup", 16)]
    assert measure.drafter_runs(8, 12)[-1] == ("recycling+lookup", 12) and len(measure.drafter_runs(16, 16)) == 3
    assert measure.drafter_runs(4, 32)[2:] == [("recycling+lookup", b) for b in (4, 8, 16)]  # the default budget too
    rows = [{"drafter": "model", "budget": 8, "measured_tokens_per_second": 90.0, "measured_speedup": 0.9},
            {"drafter": "recycling+lookup", "budget": 8, "measured_tokens_per_second": 110.0, "measured_speedup": 1.1},
            {"drafter": "recycling+lookup", "budget": 16, "measured_tokens_per_second": 120.0, "measured_speedup": 1.2}]
    chosen = estimate.recommend_drafter(rows)
    assert (chosen["drafter"], chosen["drafter_budget"]) == ("recycling+lookup", 16)
    rows = rows[:2]
    rows[1].update(measured_tokens_per_second=95.0, measured_speedup=0.95)
    slower = estimate.recommend_drafter(rows)
    assert slower["tree"] == "ar" and slower["drafter"] is None and "no draft source beat plain decoding" in slower["why"]


def test_bench_opt_drafts_as_generate_does_with_the_profile(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path))
    target, draft = pair
    recommended = dict(budget=4, delta=0.3, tree="opt", drafter="recycling+lookup", drafter_budget=8, why="test")
    profiles.save_profile({"version": profiles.PROFILE_VERSION, "key": profiles.profile_key(target, draft),
                           "recommended": recommended})
    sampled = dict(budget=4, delta=0.6, tree="opt", drafter="model+lookup", drafter_budget=6, why="test")
    profiles.save_profile({"version": profiles.PROFILE_VERSION, "key": profiles.profile_key(target, draft),
                           "recommended": recommended, profiles.SAMPLED_FIELD: sampled})
    args = argparse.Namespace(budgets=None, delta=None, temperature=0.0)
    names, chosen, budgets, delta = profile_defaults(args, target, draft, ["ar", "opt", "hf-lookup"])
    assert names == ["ar", "opt:recycling+lookup", "hf-lookup"] and chosen == "recycling+lookup"
    # its own budget; the profile's delta is the draft model's: train-free sources draft at the default
    assert parse_budgets(budgets, delta, target, draft, chosen) == [(8, DEFAULT_DELTA)]
    assert args == argparse.Namespace(budgets=None, delta=None, temperature=0.0)  # the flags as typed
    given = argparse.Namespace(budgets="4", delta=None, temperature=0.0)  # budgets given: opt means the draft model
    assert profile_defaults(given, target, draft, ["ar", "opt"]) == (["ar", "opt"], None, "4", 0.3)
    assert profiles.auto_settings(target, draft) == (4, 0.3)
    assert profiles.auto_settings(target, draft, DrafterSpec.parse("model")) == (4, 0.3)
    # a delta calibrated with the draft model is the draft model's (and any network's): lookup drafts at the
    # default (at 0.6 it stopped at depth 2: 2.13x against 2.89x)
    assert profiles.auto_settings(target, draft, DrafterSpec.parse("lookup")) == (4, DEFAULT_DELTA)
    assert profiles.auto_settings(target, draft, DrafterSpec.parse("head+lookup")) == (4, 0.3)
    settings = Settings(max_new_tokens=8, delta=0.3)  # the bench's delta from the profile: each method's as generate has it
    assert [bench_methods.method_delta(MethodSpec(name, 8), settings) for name in
            ("opt", "opt:model+lookup", "opt:lookup", "opt:recycling+lookup/fixed", "dyspec")] == \
        [0.3, 0.3, DEFAULT_DELTA, DEFAULT_DELTA, 0.3]
    assert bench_methods.method_delta(MethodSpec("opt:lookup", 8, 0.6), settings) == DEFAULT_DELTA  # 'auto'
    given = Settings(max_new_tokens=8, delta=0.45, delta_given=True)  # --delta: numeric budgets run at it, whatever drafts
    assert bench_methods.method_delta(MethodSpec("opt:lookup", 8), given) == 0.45
    assert bench_methods.method_delta(MethodSpec("opt:lookup", 8, 0.3), given) == DEFAULT_DELTA  # 'auto' in a run
    # sampling: the choice measured for sampling, as generate makes it at temperature > 0
    hot = argparse.Namespace(budgets=None, delta=None, temperature=1.0)
    names, chosen, budgets, delta = profile_defaults(hot, target, draft, ["ar", "opt"])
    assert names == ["ar", "opt:model+lookup"] and delta == 0.6
    assert parse_budgets(budgets, delta, target, draft, chosen, 1.0) == [(6, 0.6)]
    sampled.update(drafter="model")  # the draft model alone: `opt` as it is, at the budget measured with it
    profiles.save_profile({"version": profiles.PROFILE_VERSION, "key": profiles.profile_key(target, draft),
                           "recommended": recommended, profiles.SAMPLED_FIELD: sampled})
    names, chosen, budgets, delta = profile_defaults(hot, target, draft, ["ar", "opt"])
    assert names == ["ar", "opt"] and parse_budgets(budgets, delta, target, draft, chosen, 1.0) == [(6, 0.6)]
    sampled.update(tree="ar", drafter=None)  # no tree paid when sampling: opt stays the draft model's
    profiles.save_profile({"version": profiles.PROFILE_VERSION, "key": profiles.profile_key(target, draft),
                           "recommended": recommended, profiles.SAMPLED_FIELD: sampled})
    assert profile_defaults(argparse.Namespace(budgets=None, delta=None, temperature=1.0), target, draft,
                            ["ar", "opt"])[0] == ["ar", "opt"]


def test_recommendation_falls_back_to_measurement_when_the_estimate_is_off():
    rows = [{"budget": 4, "delta": 0.2, "estimated_tokens_per_second": 100.0, "measured_tokens_per_second": 50.0},
            {"budget": 8, "delta": 0.2, "estimated_tokens_per_second": 90.0, "measured_tokens_per_second": 80.0}]
    rec = estimate.recommend(rows)
    assert rec["budget"] == 8 and rec["chosen_by"].startswith("measurement")
    rows[0]["measured_tokens_per_second"] = 78.0
    rec = estimate.recommend(rows)
    assert rec["budget"] == 4 and rec["chosen_by"].startswith("estimate")
    assert rec["fraction_of_best_measured"] == pytest.approx(78 / 80)


# ---- the commands --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tok = split_char_tokenizer()
    for name, model in {"target": tiny_model("llama", seed=1), "draft": near_draft()}.items():
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": text}) + "\n"
                               for i, text in enumerate(["def f(x):", "for i in range(3):"])))
    return root / "target", root / "draft", prompts


def test_auto_brings_each_methods_own_calibrated_budget_and_sizes_its_batches(model_dirs, tmp_path, monkeypatch,
                                                                              capsys):
    """--budgets auto: a method named with draft sources runs the budget the profile measured with them
    (else the greedy choice's); its batch sizes the rows' trees (`opttree.batch_sizing`)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path / "cache"))
    target, draft, prompts = model_dirs
    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (target, draft)]
    recommended = dict(budget=4, delta=0.3, tree="opt", drafter="recycling+lookup", drafter_budget=6, why="test")
    profiles.save_profile({"version": profiles.PROFILE_VERSION, "key": profiles.profile_key(*models),
                           "recommended": recommended, profiles.SAMPLED_FIELD: recommended,
                           profiles.DRAFT_TEMPERATURE_FIELD: {"greedy": 1.0, "sampled": 1.0}})
    pair = ["--target", str(target), "--draft", str(draft), "--dtype", "float32"]
    sized = []
    monkeypatch.setattr(bench_methods, "Speculator",
                        lambda *a, **k: sized.append((k.get("budget"), k["batch_budget"])) or Speculator(*a, **k))
    from opttree import batch_sizing

    steep = batch_sizing.BatchLatency({rows: [float(rows * w) for w in batch_sizing.WIDTHS] for rows in (1, 2)})
    monkeypatch.setitem(batch_sizing._MEASURED, batch_sizing.latency_path(models[0]), steep)  # 2 rows: 1 node each
    rc = main(["bench", *pair, "--prompts", str(prompts), "--methods", "opt:recycling+lookup,opt:lookup,chain",
               "--budgets", "auto", "--max-new-tokens", "6", "--out", str(tmp_path / "b"), "--no-progress", "--json",
               "--batch", "2"])
    assert rc == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["category"] == "all"]
    budgets = {r["method"]: r["budget"] for r in rows}
    assert budgets == {"ar": None, "opt:recycling+lookup": 6, "opt:lookup": 4, "chain": 4, "ar x2": None,
                       "opt:recycling+lookup x2": 6, "opt:lookup x2": 4, "chain x2": 4}
    assert {sharing for budget, sharing in sized if budget} == {"sized"}  # 'auto' is the one-sequence choice
    sized_rows = {r["method"]: r["row_budgets"] for r in rows}  # what the batches' rows drafted, when not that
    assert sized_rows["opt:recycling+lookup x2"] == [1] and sized_rows["opt:recycling+lookup"] == []
    assert sized_rows["ar x2"] == sized_rows["ar"] == []  # plain decoding drafts nothing to size
    assert "6 (δ 0.1), sized to 1" in (tmp_path / "b" / "results.md").read_text()


def test_a_bare_opt_runs_the_chain_the_profile_chose_for_sampling_at_its_budget(model_dirs, tmp_path, monkeypatch,
                                                                                 capsys):
    """No --budgets, temperature 0.7, a profile whose sampling choice is the chain of 3 draws: the bench's `opt` is
    that chain at 3 nodes (what generate runs), under its own name."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path / "cache"))
    target, draft, prompts = model_dirs
    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (target, draft)]
    recommended = dict(budget=6, delta=0.3, tree="opt", drafter="model", drafter_budget=6, why="test")
    sampled = dict(budget=6, delta=0.3, tree="chain", drafter="model", drafter_budget=measure.SAMPLED_CHAIN, why="t")
    profiles.save_profile({"version": profiles.PROFILE_VERSION, "key": profiles.profile_key(*models),
                           "recommended": recommended, profiles.SAMPLED_FIELD: sampled,
                           profiles.DRAFT_TEMPERATURE_FIELD: {"greedy": 1.0, "sampled": 1.0}})
    pair = ["--target", str(target), "--draft", str(draft), "--dtype", "float32"]
    rc = main(["bench", *pair, "--prompts", str(prompts), "--methods", "ar,opt", "--temperature", "0.7",
               "--max-new-tokens", "6", "--out", str(tmp_path / "b"), "--no-progress", "--json"])
    assert rc == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["category"] == "all"]
    assert {r["method"]: r["budget"] for r in rows} == {"ar": None, "chain": measure.SAMPLED_CHAIN}


def test_bench_batch_runs_each_method_alone_and_batched_and_checks_every_row(model_dirs, tmp_path, monkeypatch,
                                                                             capsys):
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path / "cache"))
    target, draft, prompts = model_dirs
    pair = ["--target", str(target), "--draft", str(draft), "--dtype", "float32"]
    rc = main(["bench", *pair, "--prompts", str(prompts), "--methods", "opt,opt:recycling+lookup,hf-ar", "--budgets",
               "4", "--batch", "2", "--max-new-tokens", "10", "--out", str(tmp_path / "b"), "--no-progress", "--json"])
    assert rc == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["category"] == "all"]
    assert [r["method"] for r in rows] == ["ar", "ar x2", "opt", "opt x2", "opt:recycling+lookup",
                                           "opt:recycling+lookup x2", "hf-ar", "hf-ar x2"]
    assert all(r["mismatches"] == 0 for r in rows)  # every batched row is plain greedy decoding's output
    records = json.loads((tmp_path / "b" / "results.json").read_text())["records"]
    assert {r["batch"] for r in records} == {1, 2}
    rc = main(["bench", *pair, "--prompts", str(prompts), "--methods", "hf-assisted", "--batch", "2",
               "--max-new-tokens", "4", "--out", str(tmp_path / "c"), "--no-progress"])
    assert rc == 2 and "hf-assisted takes one prompt at a time" in capsys.readouterr().err


def test_the_batch_warm_up_runs_a_batch_of_the_timed_size(model_dirs, tmp_path, monkeypatch):
    """What a batch of B rows times once per machine (its latency table) happens in the warm-up, not in a
    timed run: the first batch run is B rows."""
    from opttree.bench import runner as bench_runner

    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path / "cache"))
    target, draft, _ = model_dirs
    prompts = tmp_path / "four.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": f"def f{i}(x):"}) + "\n" for i in range(4)))
    sizes = []
    build = bench_runner.build_runners

    def counted(*args, **kwargs):
        return {label: (lambda ids, run=run: sizes.append(len(ids) if isinstance(ids, list) else 1) or run(ids))
                for label, run in build(*args, **kwargs).items()}

    monkeypatch.setattr(bench_runner, "build_runners", counted)
    rc = main(["bench", "--target", str(target), "--draft", str(draft), "--dtype", "float32", "--prompts",
               str(prompts), "--methods", "opt", "--budgets", "4", "--batch", "3", "--max-new-tokens", "4",
               "--out", str(tmp_path / "b"), "--no-progress"])
    assert rc == 0 and [n for n in sizes if n > 1][0] == 3


def test_bench_says_when_opttree_runs_packed_layers_and_the_peers_do_not(model_dirs, tmp_path, monkeypatch, capsys):
    from opttree.packed import packing_applies

    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path / "cache"))
    if not packing_applies(tiny_model("llama").to(torch.bfloat16)):
        pytest.skip("no oneDNN bf16 matrix kernels on this CPU")
    target, draft, prompts = model_dirs
    rc = main(["bench", "--target", str(target), "--draft", str(draft), "--dtype", "bfloat16", "--prompts",
               str(prompts), "--methods", "hf-ar", "--max-new-tokens", "4", "--out", str(tmp_path / "b"),
               "--no-progress"])
    assert rc == 0 and "the hf-* peers run transformers' own" in capsys.readouterr().err
    meta = json.loads((tmp_path / "b" / "results.json").read_text())["meta"]
    assert meta["packed"]["target"] and "opttree's layers packed" in (tmp_path / "b" / "results.md").read_text()


def test_bench_and_calibrate_commands(model_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path / "cache"))
    target, draft, prompts = model_dirs
    pair = ["--target", str(target), "--draft", str(draft), "--dtype", "float32"]
    out = tmp_path / "bench"
    rc = main(["bench", *pair, "--prompts", str(prompts), "--methods", "opt,hf-assisted,hf-lookup", "--budgets", "2,4",
               "--max-new-tokens", "10", "--out", str(out), "--no-progress", "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["method"], r["budget"]) for r in rows if r["category"] == "all"] == [
        ("ar", None), ("opt", 2), ("opt", 4), ("hf-assisted", None), ("hf-lookup", None)]
    assert all(r["mismatches"] == 0 for r in rows)
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"meta", "prompts", "skipped", "records", "summary", "slow_runs"}
    assert len(results["records"]) == 2 * 5 and results["meta"]["command"].startswith("opttree bench --target")
    assert results["meta"]["packed"] == {"target": False, "draft": False}  # float32 weights too small to pack

    rc = main(["calibrate", *pair, "--prompts", str(prompts), "--max-tokens", "5", "--context", "16", "--repeats", "2",
               "--budgets", "1,2", "--deltas", "0.2", "--max-new-tokens", "6", "--out", str(tmp_path / "cal"),
               "--no-progress", "--json", "--save-disturbed"])  # tiny models' sub-ms timings may look unsteady
    assert rc == 0
    rec = json.loads(capsys.readouterr().out)
    assert (tmp_path / "cal" / "profile.json").exists()

    rc = main(["generate", *pair, "--prompt", "def g(", "--budget", "auto", "--max-new-tokens", "6", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["budget"] == (rec.get("drafter_budget") or rec["budget"]) and report["tree"] == rec["tree"]
    assert rec["tree"] == "ar" or report["drafter"] == rec["drafter"]  # the sources calibrate measured fastest

    cached = [p for p in (tmp_path / "cache" / "profiles").glob("*.json") if "recommended" in p.read_text()][0]
    profile = json.loads(cached.read_text())
    for tree, drafter in (("opt", "recycling+lookup"), ("ar", None)):  # as calibrate would write them
        profile["recommended"].update(tree=tree, drafter=drafter, why="measured")
        cached.write_text(json.dumps(profile))
        assert main(["generate", *pair, "--prompt", "def g(", "--max-new-tokens", "6", "--json"]) == 0
        captured = capsys.readouterr()
        report = json.loads(captured.out)
        assert (report["tree"], report["drafter"]) == (tree, drafter)  # a train-free drafter: the draft goes unused
        assert (tree == "ar") == ("plain decoding (--tree ar)" in captured.err)
        assert main(["generate", *pair, "--prompt", "def g(", "--max-new-tokens", "6", "--json", "--tree", "opt",
                     "--drafter", "model"]) == 0  # flags given win
        assert json.loads(capsys.readouterr().out)["drafter"] == "model"
    rc = main(["bench", *pair, "--prompts", str(prompts), "--methods", "opt", "--limit", "1",
               "--max-new-tokens", "6", "--out", str(out), "--no-progress", "--json"])  # no --budgets: the profile's
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["budget"] for r in rows if r["method"] == "opt"] == [rec["budget"]] * 2  # "all" and the category
    assert json.loads((out / "results.json").read_text())["meta"]["settings"]["delta"] == rec["delta"]


def test_calibrate_quick_honours_limit_and_keeps_a_disturbed_profile_out_of_use(model_dirs, tmp_path, monkeypatch,
                                                                             capsys):
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cal_run, "noise_problem", lambda before, after: "a busy spell (test)")
    target, draft, _ = model_dirs
    rc = main(["calibrate", "--target", str(target), "--draft", str(draft), "--dtype", "float32", "--quick",
               "--limit", "1", "--context", "8", "--max-tokens", "4", "--budgets", "1,2",
               "--out", str(tmp_path / "cal"), "--no-progress", "--json"])
    assert rc == 0
    captured = capsys.readouterr()
    rec = json.loads(captured.out)
    assert rec["disturbed"] and "NOT used by --budget auto" in captured.err
    profile = json.loads((tmp_path / "cal" / "profile.json").read_text())
    assert profile["settings"]["prompts"] == 1 and profile["settings"]["repeats"] == 3  # --limit; --quick's repeats
    assert profile["settings"]["max_new_tokens"] == 48  # --quick's
    assert profile["settings"]["source_tokens"] == 128  # the draft sources compared over longer generations
    assert [r["delta"] for r in profile["grid"]] == [0.3, 0.6, 0.3, 0.6]  # --quick's delta grid
    assert not list((tmp_path / "cache").glob(f"**/{profile['key']}.json"))  # not where --budget auto looks


def test_bench_errors_are_clear(model_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path / "empty-cache"))
    target, draft, prompts = model_dirs
    common = ["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts), "--no-progress",
              "--out", str(tmp_path / "o")]
    assert main([*common, "--methods", "opt,warp-drive"]) == 2
    assert "unknown method 'warp-drive'; available: ar" in capsys.readouterr().err
    assert main([*common, "--budgets", "auto"]) == 2
    assert "run `opttree calibrate`" in capsys.readouterr().err
    assert main([*common, "--prompts", str(tmp_path / "nope.jsonl")]) == 2
    assert "prompt file not found" in capsys.readouterr().err
    assert main(["bench", "--target", str(target), "--prompts", str(prompts), "--methods", "opt", "--out",
                 str(tmp_path / "o")]) == 2
    assert "need a draft model" in capsys.readouterr().err


def test_list_of_methods_includes_every_policy():
    from opttree.step.policies import available

    names = list(bench_methods.method_table())
    assert set(available()) <= set(names)
    assert {"hf-assisted", "hf-assisted-heuristic", "hf-lookup"} <= set(names)
    assert torch.get_num_threads() == 1  # conftest: tiny models run single-threaded


def test_a_new_pair_is_calibrated_on_first_use(model_dirs, tmp_path, monkeypatch, capsys):
    """generate with default settings and no profile here: a quick calibration first, saved, said once."""
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(cal_run.AUTO_ENV, "1")
    monkeypatch.setattr(cal_run, "FIRST_USE", dict(prompts=1, max_tokens=4, repeats=2, max_new_tokens=6, budgets=(1, 2),
                                               deltas=(0.2,)))
    monkeypatch.setattr(cal_run, "noise_problem", lambda before, after: "")  # sub-ms timings of tiny models
    target, draft, _ = model_dirs
    pair = ["--target", str(target), "--draft", str(draft), "--dtype", "float32"]
    assert main(["generate", *pair, "--prompt", "def g(", "--max-new-tokens", "6", "--json", "--budget", "2"]) == 0
    assert "calibrat" not in capsys.readouterr().err  # settings given: nothing to calibrate
    assert main(["generate", *pair, "--prompt", "def g(", "--max-new-tokens", "6", "--json"]) == 0
    captured = capsys.readouterr()
    assert "a quick one first" in captured.err and "opttree: calibrated in" in captured.err
    saved = [json.loads(p.read_text()) for p in (tmp_path / "cache" / "profiles").glob("*.json")]
    profile = [p for p in saved if "recommended" in p][0]
    report = json.loads(captured.out)
    chosen = profile["recommended"]  # the chosen draft source's own budget where it has one (timing decides which)
    assert report["budget"] == (chosen.get("drafter_budget") or chosen["budget"]) and report["tree"] == chosen["tree"]
    assert main(["generate", *pair, "--prompt", "def g(", "--max-new-tokens", "6", "--json"]) == 0
    assert "a quick one first" not in capsys.readouterr().err  # once per pair and machine
    path = next(p for p in (tmp_path / "cache" / "profiles").glob("*.json") if "recommended" in json.loads(p.read_text()))
    stale = dict(profile, recommended={k: v for k, v in chosen.items() if k not in ("tree", "drafter", "why")})
    path.write_text(json.dumps({k: v for k, v in stale.items() if k != profiles.SAMPLED_FIELD}))  # before the sources
    assert main(["generate", *pair, "--prompt", "def g(", "--max-new-tokens", "6", "--json"]) == 0
    assert "predates the draft sources' measurements" in capsys.readouterr().err  # measured again, once
    assert profiles.measured_sources(json.loads(path.read_text()))
    assert main(["generate", *pair, "--prompt", "def g(", "--max-new-tokens", "6", "--json"]) == 0
    assert "a quick one first" not in capsys.readouterr().err
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # this process spins; the profile was measured passively
    measured = json.loads(path.read_text())
    path.write_text(json.dumps(dict(measured, machine=dict(measured["machine"], omp_wait_policy="PASSIVE"))))
    assert main(["generate", *pair, "--prompt", "def g(", "--max-new-tokens", "6", "--json"]) == 0
    assert "measured with OpenMP's passive waiting" in capsys.readouterr().err  # measured again, once
    assert main(["generate", *pair, "--prompt", "def g(", "--max-new-tokens", "6", "--json"]) == 0
    assert "a quick one first" not in capsys.readouterr().err
    measured = json.loads(path.read_text())  # measured before the step's costs changed (an older step revision)
    path.write_text(json.dumps(dict(measured, step_revision=cal_run.STEP_REVISION - 1)))
    assert main(["generate", *pair, "--prompt", "def g(", "--max-new-tokens", "6", "--json"]) == 0
    assert "measured by an older opttree" in capsys.readouterr().err  # measured again, once
    assert json.loads(path.read_text())["step_revision"] == cal_run.STEP_REVISION
    assert main(["generate", *pair, "--prompt", "def g(", "--max-new-tokens", "6", "--json"]) == 0
    assert "a quick one first" not in capsys.readouterr().err
    # bench: `opt` with the defaults reads the profile, so a pair new here is calibrated first too
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path / "bench-cache"))
    prompts = model_dirs[2]
    bench = ["bench", *pair, "--prompts", str(prompts), "--limit", "1", "--max-new-tokens", "4", "--no-progress",
             "--out", str(tmp_path / "b")]
    assert main([*bench, "--methods", "opt", "--budgets", "2"]) == 0
    assert "a quick one first" not in capsys.readouterr().err  # budgets given: nothing read from a profile
    assert main([*bench, "--methods", "opt"]) == 0
    assert "a quick one first" in capsys.readouterr().err
    assert list((tmp_path / "bench-cache" / "profiles").glob("*.json"))


def test_plain_text_prompts_may_span_lines_between_separators(tmp_path):
    from opttree.bench.prompts import load_prompts

    one_per_line = tmp_path / "lines.txt"
    one_per_line.write_text("def f(x):\n\nclass A:\n")
    assert [p.text for p in load_prompts(one_per_line)] == ["def f(x):", "class A:"]
    blocks = tmp_path / "blocks.txt"
    blocks.write_text("def f(x):\n    \"\"\"Twice x.\"\"\"\n---\n\nclass A:\n\n    def g(self):\n---\n")
    assert [p.text for p in load_prompts(blocks)] == ["def f(x):\n    \"\"\"Twice x.\"\"\"\n",
                                                      "class A:\n\n    def g(self):\n"]


def test_method_names_take_a_depth_control():
    assert bench_methods.parse_tree_method("opt:lookup+model/thompson") == ("opt", DrafterSpec(("model", "lookup")),
                                                                            "thompson", "auto")
    assert bench_methods.parse_tree_method("opt") == ("opt", None, "delta", "auto")
    assert bench_methods.parse_tree_method("eagle2:model~top") == ("eagle2", DrafterSpec(("model",)), "delta", "top")
    assert bench_methods.find_method("opt/fixed").needs_draft and not bench_methods.find_method("opt:head/fixed").needs_draft
    with pytest.raises(ValueError, match="unknown depth control 'greedy'"):
        bench_methods.find_method("opt/greedy")


def test_the_sampled_runs_are_each_measured_once_at_every_greedy_budget():
    """At budgets 1 and 2 half of the budget, the budget and half as much again coincide: one run each (a
    calibration whose greedy choice was budget 1 measured 5 runs where its list named 6)."""
    for budget in range(1, 41):
        runs = measure.sampled_runs(budget)
        assert len(runs) == len(set(runs)) and ("model", budget, "opt") in runs and ("model", 2, "opt") in runs
        assert ("model", measure.SAMPLED_CHAIN, "chain") in runs  # speculative sampling's chain, verified as a block


def test_a_sampled_choice_of_a_chain_is_what_a_sampled_generation_runs(pair, tmp_path, monkeypatch):
    """A profile whose sampling choice is the chain of 3 draws: `opttree generate` at temperature > 0 with no
    flags drafts that chain (3 nodes a step at most, one draft forward a node), greedy decoding keeps its tree."""
    from opttree.cli import build_parser
    from opttree.flags import tree_options

    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(tmp_path))
    target, draft = pair
    recommended = dict(budget=8, delta=0.3, tree="opt", drafter="model", drafter_budget=8, why="test")
    sampled = dict(budget=8, delta=0.3, tree="chain", drafter="model", drafter_budget=measure.SAMPLED_CHAIN, why="t")
    profiles.save_profile({"version": profiles.PROFILE_VERSION, "key": profiles.profile_key(target, draft),
                           "recommended": recommended, profiles.SAMPLED_FIELD: sampled,
                           profiles.DRAFT_TEMPERATURE_FIELD: {"greedy": 0.5, "sampled": 1.0}})
    hot = tree_options(build_parser().parse_args(["generate", "--prompt", "x", "--temperature", "0.7"]), target, draft)
    assert (hot["tree"], hot["budget"]) == ("chain", measure.SAMPLED_CHAIN)
    cold = tree_options(build_parser().parse_args(["generate", "--prompt", "x"]), target, draft)
    assert (cold["tree"], cold["budget"]) == ("opt", 8)
    hot_bench = argparse.Namespace(budgets=None, delta=None, temperature=0.7)  # the bench's bare `opt` runs it too
    names, chosen, budgets, delta = profile_defaults(hot_bench, target, draft, ["ar", "opt", "chain"])
    assert names == ["ar", "chain"] and chosen == "model"
    assert parse_budgets(budgets, delta, target, draft, chosen, 0.7) == [(measure.SAMPLED_CHAIN, 0.3)]
    cold_bench = argparse.Namespace(budgets=None, delta=None, temperature=0.0)
    assert profile_defaults(cold_bench, target, draft, ["ar", "opt"])[:2] == (["ar", "opt"], "model")
    prompt = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(0))
    out = opttree.generate(target, prompt, draft, **{**hot, "temperature": 0.7}, max_new_tokens=12, seed=0)
    stats = out.stats
    chain = measure.SAMPLED_CHAIN
    assert stats.steps and stats.drafted_tokens <= chain * stats.steps < stats.drafted_tokens + stats.steps


def test_each_method_learns_from_its_own_runs_only(pair, cases):
    """Token Recycling's matrix and lookup's hit rates learn across generations with the same target. In a bench,
    one method running a prompt after another must not start from what the other just learnt there: the same
    method twice (two labels) emits the same tokens in the same steps on every prompt, whichever runs first."""
    from opttree.bench.methods import MethodSpec
    from opttree.step.drafters.estimates import forget, kept_apart, per_model

    target, draft = pair
    specs = [MethodSpec("ar"), MethodSpec("opt:recycling+lookup", 8), MethodSpec("opt:recycling+lookup", 8, 0.1)]
    records = run_bench(target, draft, cases * 2, specs, Settings(max_new_tokens=24, eos_token_id=None),
                        progress=False)
    first = [r for r in records if r["label"] == specs[1].label]
    second = [r for r in records if r["label"] == specs[2].label]
    assert len(first) == len(second) == 6
    for a, b in zip(first, second):  # in prompt order; the order of the two on a prompt rotates
        assert a["token_ids"] == b["token_ids"] and a["accepted_histogram"] == b["accepted_histogram"]
    forget(target)
    shared = per_model(target, "probe", lambda: "shared")
    with kept_apart(target, {}) as own:
        assert per_model(target, "probe", lambda: "own") == "own" and own == {"probe": "own"}
    assert per_model(target, "probe", lambda: "new") == shared == "shared"  # the shared state is back
    forget(target)
