"""`opttree generate` end to end on tiny models saved to disk."""

import json
import os

import pytest
from helpers import char_tokenizer, hf_greedy, tiny_model

from opttree.cli import main


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tok = char_tokenizer()
    for name, kw in {"target": dict(seed=1), "draft": dict(seed=2, layers=1, hidden=32)}.items():
        tiny_model("llama", **kw).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root / "target", root / "draft"


@pytest.mark.parametrize("static", [None, "--static", "--no-static", "--min-p"])
def test_generate_json_matches_greedy_decoding(model_dirs, capsys, static):
    """(--min-p 1 at temperature 1 leaves one token a position: the greedy one.)"""
    target, draft = model_dirs
    flags = ["--temperature", "1", "--min-p", "1"] if static == "--min-p" else [static] if static else []
    rc = main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "abcdef", "--dtype", "float32",
               "--max-new-tokens", "20", "--budget", "8", "--json", *flags])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["static"] is {"--static": True, "--no-static": False}.get(static, os.environ.get("OPTTREE_STATIC") == "1")
    assert (result["temperature"], result["min_p"]) == ((1.0, 1.0) if static == "--min-p" else (0.0, 0.0))
    tok = char_tokenizer()
    model = tiny_model("llama", seed=1)
    ids = tok("abcdef", return_tensors="pt").input_ids
    ref = hf_greedy(model, ids, 20, eos_token_id=tok.eos_token_id)[0, ids.shape[1]:]
    assert result["token_ids"] == ref.tolist()
    assert result["text"] == tok.decode(ref)
    assert result["new_tokens"] == len(ref) and result["steps"] >= 1
    assert result["mean_accepted_length"] == pytest.approx(result["new_tokens"] / result["steps"])
    for key in ("tokens_per_second", "time_s"):
        assert result[key] > 0


def test_generate_streams_text(model_dirs, capsys):
    target, draft = model_dirs
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "xyz", "--max-new-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("xyz") and "mean accepted length" in captured.err


def test_generate_without_a_draft_uses_the_train_free_sources(model_dirs, capsys):
    target, _ = model_dirs
    assert main(["generate", "--target", str(target), "--prompt", "xyz", "--max-new-tokens", "6", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["drafter"] == "recycling+lookup" and report["new_tokens"] == 6


def test_bad_input_is_a_clear_error_not_a_traceback(model_dirs, capsys):
    target, draft = model_dirs
    rc = main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "abc", "--temperature", "-1"])
    assert rc == 2 and "--temperature must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--budget", "0"], "argument --budget: budget must be an integer >= 1 or 'auto', got '0'"),
    (["--budget", "lots"], "argument --budget: budget must be an integer"),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
    (["--target", "{tmp}/nope", "--draft", "{draft}"], "--target {tmp}/nope: no such directory"),
    (["--target", "{tmp}/file.txt", "--draft", "{draft}"], "is a file; pass the model's directory"),
    (["--target", "{tmp}", "--draft", "{draft}"], "no model here (expected config.json"),
    (["--target", "{target}", "--draft", "{tmp}/nope"], "--draft {tmp}/nope: no such directory"),
    (["--drafter", "model+lookahead"], "argument --drafter: unknown draft source 'lookahead'"),
    (["--drafter", "lookup"], "--draft is given but --drafter lookup does not use it"),
    (["--drafter", "lookup", "--tree", "ar", "--target", "{target}"], "--tree ar drafts nothing"),
    (["--prompt-file", "{tmp}/bad.txt"], "not valid UTF-8"),
    (["--min-p", "1.5"], "--min-p must be in [0, 1] (0 = off), got 1.5"),
])
def test_cli_errors_are_one_line_before_models_load(model_dirs, tmp_path, capsys, flags, message):
    target, draft = model_dirs
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "bad.txt").write_bytes(b"abc\xff\xfe")
    fill = dict(tmp=tmp_path, target=target, draft=draft)
    flags = [f.format(**fill) for f in flags]
    base = ["--target", str(target), "--draft", str(draft)] if "--target" not in flags else []
    if "--prompt-file" not in flags:
        base += ["--prompt", "abc"]
    assert main(["generate", *base, *flags]) == 2
    err = capsys.readouterr().err
    assert message.format(**fill) in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bench_out_pointing_at_a_file_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["bench", "--prompts", str(tmp_path / "f"), "--out", str(tmp_path / "f")]) == 2
    assert "is a file; pass a directory" in capsys.readouterr().err


def test_prompt_file_holds_a_multi_line_prompt(model_dirs, tmp_path, capsys):
    target, draft = model_dirs
    (tmp_path / "p.txt").write_text("ab\ncd")
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt-file", str(tmp_path / "p.txt"),
                 "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ab\ncd") and out.endswith("\n")


def test_every_command_gets_thread_settings_that_hold_up(monkeypatch):
    """Passive OpenMP waiting on a busy machine only (set before torch loads), a user's choice kept,
    and torch's threads = the usable cores; importing the package alone loads no torch."""
    import importlib
    import os
    import subprocess
    import sys
    import time

    from opttree import threads

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cores = threads.usable_cores()
    samples = iter([(0, 0), (100 * cores, 100 * cores),  # every usable core busy while sampled
                    (0, 0), (10 * cores, 100 * cores)])  # a tenth of them
    monkeypatch.setattr(threads, "cpu_times", lambda: next(samples))
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 0.0, 0.0))  # a job that has just ended: not busy now
    assert threads.choose_openmp_wait_policy() == "PASSIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert threads.choose_openmp_wait_policy() == "default"
    monkeypatch.setattr(threads, "cpu_times", lambda: None)  # no /proc/stat: the load average decides
    assert threads.choose_openmp_wait_policy() == "PASSIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert threads.choose_openmp_wait_policy() == "default"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 0.0, 0.0))
    assert threads.choose_openmp_wait_policy() == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    importlib.reload(importlib.import_module("opttree.train.cli"))  # the main CLI imports it for every command
    assert "OMP_WAIT_POLICY" not in os.environ
    assert threads.choose_openmp_wait_policy(passive=True) == "PASSIVE"  # what `opttree train` asks
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a real busy core, read from /proc/stat
    try:
        time.sleep(0.3)
        monkeypatch.undo()
        assert threads.busy_cores() is None or threads.busy_cores() >= 0.5
    finally:
        busy.kill()

    code = ("import os; import opttree.cli as c; c.threads.set_torch_threads(); import torch; "
            "print(torch.get_num_threads(), len(os.sched_getaffinity(0)))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout.split()
    assert out[0] == out[1]
    out = subprocess.run([sys.executable, "-c", "import opttree, sys; print('torch' in sys.modules)"],
                         capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert out == "False"


def test_eager_attention_from_the_cli_without_progress_bars(model_dirs, capsys):
    target, draft = model_dirs
    rc = main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "abcdef", "--dtype", "float32",
               "--max-new-tokens", "12", "--budget", "4", "--attn-implementation", "eager", "--json"])
    captured = capsys.readouterr()
    tok = char_tokenizer()
    ids = tok("abcdef", return_tensors="pt").input_ids
    ref = hf_greedy(tiny_model("llama", seed=1), ids, 12, eos_token_id=tok.eos_token_id)[0, ids.shape[1]:]
    assert rc == 0 and json.loads(captured.out)["token_ids"] == ref.tolist()
    assert "Loading weights" not in captured.err


@pytest.mark.parametrize("packs", [True, False])
def test_compile_where_eager_runs_packed_weights_says_it_is_slower(model_dirs, monkeypatch, capsys, packs):
    """`--compile` on a CPU whose eager steps run packed bf16 weights (`opttree.packed`) says that the compiled
    steps do not use them; elsewhere it says nothing. The models are only loaded and wrapped here."""
    from opttree import packed
    from opttree.cli import build_parser
    from opttree.flags import load_pair

    target, draft = model_dirs
    monkeypatch.setattr(packed, "packing_applies", lambda model: packs)
    args = build_parser().parse_args(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "a",
                                      "--dtype", "float32", "--compile"])
    load_pair(args)
    said = "compiled steps do not" in capsys.readouterr().err
    assert said is packs
