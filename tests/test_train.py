"""Training tooling: tokenizer round-trip, corpus split, LM training, checkpoint/resume, distillation."""

import argparse
import copy

import numpy as np
import pytest
import torch

from opttree.train.corpus import encode_documents, load_texts, split_files, top_level_name
from opttree.step.drafters.model import declared_window
from opttree.train.distill import evaluate_pair, load_draft, make_distill_loss, train_draft
from opttree.train.lm import (ModelShape, TrainConfig, build_llama, eval_windows, evaluate_lm, load_checkpoint,
                              lm_loss, lr_at, make_optimizer, save_final, train_loop, WindowSampler)
from opttree.train.tokenizer import load_tokenizer, train_tokenizer

CODE = '''def add(a, b):
    """Return the sum."""
    return a + b


class Counter:
    def __init__(self):
        self.n = 0

    def bump(self, k=1):
        self.n += k
        return self.n
'''
TINY = ModelShape(hidden=32, layers=1, heads=2, intermediate=64)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer([CODE * 3, "import os\nprint('hi')\n\tx = 1\n"], vocab_size=300, out_dir=out)
    return load_tokenizer(out)


@pytest.fixture(scope="module")
def tokens(tokenizer):
    return encode_documents(tokenizer, [CODE] * 40)


def test_tokenizer_round_trips_exactly(tokenizer):
    samples = ["", " ", "  leading spaces", "\ttab\tseparated\t", "\n\nnewlines\r\n\r\n", "trailing  \n",
               "unicode: héllo wörld 日本語 🐍 ∑", CODE, "a  b   c    d", "<|endoftext|> inside text"]
    for text in samples:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert tokenizer(" x", add_special_tokens=False)["input_ids"] != tokenizer("x", add_special_tokens=False)["input_ids"]
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id is not None


def test_corpus_split_is_fixed_and_skips_site_packages(tmp_path):
    for rel in ["json/__init__.py", "json/decoder.py", "os.py", "test/test_json/t.py", "site-packages/x/y.py",
                "email/mime/text.py", "notes.txt", "json.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(f"# {rel}\n".encode() + b"\xff\n")  # invalid utf-8 byte is skipped
    split = split_files(tmp_path, ("json", "email"))
    assert split["train"] == ["os.py", "test/test_json/t.py"]
    assert split["heldout"] == ["email/mime/text.py", "json.py", "json/__init__.py", "json/decoder.py"]
    assert top_level_name("email/mime/text.py") == "email" and top_level_name("json.py") == "json"
    assert load_texts(tmp_path, "train", ("json", "email")) == ["# os.py\n\n", "# test/test_json/t.py\n\n"]


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(run_dir=".", lr=1.0, warmup_steps=10, min_lr_ratio=0.1, steps=100)
    assert lr_at(0, 0.0, cfg) == pytest.approx(0.1)
    assert lr_at(9, 0.09, cfg) == pytest.approx(0.5 * (1 + np.cos(np.pi * 0.09)) * 0.9 + 0.1)
    assert lr_at(50, 1.0, cfg) == pytest.approx(0.1)
    assert lr_at(50, 0.5, cfg) == pytest.approx(0.55)


def _cfg(tmp_path, **kw):
    base = dict(run_dir=tmp_path, seq_len=32, batch_size=8, lr=3e-3, warmup_steps=5, steps=40, eval_every=1000,
                eval_windows=8, bf16=False, seed=0)
    return TrainConfig(**{**base, **kw})


def test_lm_training_reduces_heldout_loss(tmp_path, tokenizer, tokens):
    torch.manual_seed(0)
    model = build_llama(TINY, tokenizer, max_positions=64)
    windows = eval_windows(tokens, 32, 8)
    before = evaluate_lm(model, windows, bf16=False)["heldout_loss"]
    metrics = train_loop(model, lm_loss, tokens, lambda m: evaluate_lm(m, windows, False), _cfg(tmp_path, bf16=True))
    assert metrics["step"] == 40
    assert metrics["heldout_loss"] < before - 1.5, (before, metrics)
    assert (tmp_path / "ckpt.pt").exists() and (tmp_path / "log.jsonl").exists()


def test_checkpoint_resume_equals_uninterrupted_run(tmp_path, tokenizer, tokens):
    def fresh():
        torch.manual_seed(0)
        return build_llama(TINY, tokenizer, max_positions=64)

    no_eval = lambda m: {}
    straight = fresh()
    train_loop(straight, lm_loss, tokens, no_eval, _cfg(tmp_path / "a", steps=20))

    interrupted = fresh()
    train_loop(interrupted, lm_loss, tokens, no_eval, _cfg(tmp_path / "b", steps=20, stop_after=8))
    restored, cfg = fresh(), _cfg(tmp_path / "b", steps=20)
    optimizer = make_optimizer(restored, cfg)
    step, _ = load_checkpoint(tmp_path / "b" / "ckpt.pt", restored, optimizer, WindowSampler(tokens, 32, 8, 0))
    assert step == 8
    assert all(torch.equal(p, q) for p, q in zip(interrupted.state_dict().values(), restored.state_dict().values()))
    assert all(s["step"].item() == 8 for s in optimizer.state_dict()["state"].values())
    assert not torch.equal(straight.model.embed_tokens.weight, restored.model.embed_tokens.weight)

    resumed = fresh()
    train_loop(resumed, lm_loss, tokens, no_eval, _cfg(tmp_path / "b", steps=20, resume=True))
    for (name, p), q in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(p, q), name


def test_saved_model_loads_with_from_pretrained_and_same_logits(tmp_path, tokenizer, tokens):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = build_llama(TINY, tokenizer, max_positions=64).eval()
    save_final(model, tokenizer, tmp_path / "final")
    assert model.dtype == torch.float32  # saving does not alter the trained model
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), dtype=torch.float32).eval()
    reference = copy.deepcopy(model)
    for p in reference.parameters():  # weights are stored in bf16 (buffers such as rope inv_freq are not)
        p.data = p.data.to(torch.bfloat16).to(torch.float32)
    ids = torch.from_numpy(tokens[:40].astype(np.int64))[None]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)
    assert AutoTokenizer.from_pretrained(str(tmp_path / "final")).decode(tokenizer(CODE)["input_ids"]) == CODE
    assert loaded.config.tie_word_embeddings


def test_distillation_reduces_kl_to_target(tmp_path, tokenizer, tokens):
    torch.manual_seed(0)
    target = build_llama(ModelShape(64, 2, 2, 128), tokenizer, max_positions=64)
    windows = eval_windows(tokens, 32, 8)
    train_loop(target, lm_loss, tokens, lambda m: {}, _cfg(tmp_path / "t", steps=80))  # a confident target
    target.eval().requires_grad_(False)
    torch.manual_seed(1)
    draft = build_llama(TINY, tokenizer, max_positions=64)
    before = evaluate_pair(target, draft, windows, bf16=False)
    after = train_loop(draft, make_distill_loss(target, ce_weight=0.0), tokens,
                       lambda m: evaluate_pair(target, m, windows, bf16=False), _cfg(tmp_path / "d", steps=80))
    assert after["heldout_kl"] < 0.5 * before["heldout_kl"], (before, after)
    assert after["top1_agreement"] > before["top1_agreement"] + 0.2, (before, after)
    assert 0.0 <= after["top1_agreement"] <= 1.0


def test_a_saved_draft_trains_further_from_its_own_weights(tmp_path, tokenizer, tokens):
    """`train draft --init DIR`: the draft saved in DIR, its shape and weights, is trained further (its first
    evaluation is the saved draft's own), and a draft with another vocabulary is refused by name."""
    torch.manual_seed(0)
    target = build_llama(ModelShape(64, 2, 2, 128), tokenizer, max_positions=64)
    train_loop(target, lm_loss, tokens, lambda m: {}, _cfg(tmp_path / "t", steps=80))  # a confident target
    target.eval().requires_grad_(False)
    saved = build_llama(ModelShape(48, 1, 2, 96), tokenizer, max_positions=64)
    save_final(saved, tokenizer, tmp_path / "saved")
    windows = eval_windows(tokens, 32, 8)
    first = evaluate_pair(target, load_draft(tmp_path / "saved", target), windows, bf16=False)
    draft, metrics = train_draft(target, tokenizer, tokens, tokens, TINY, _cfg(tmp_path / "d", steps=20),
                                 log=lambda _: None, init=tmp_path / "saved")
    assert metrics["shape"] == {"hidden": 48, "layers": 1, "heads": 2, "intermediate": 96}  # its own, not TINY
    assert metrics["heldout_kl"] < first["heldout_kl"], (first, metrics)
    saved_window = declared_window(load_draft(tmp_path / "d" / "final", target))
    assert saved_window == _cfg(tmp_path / "d", steps=20).seq_len // 2  # the window it drafts over by default
    other = build_llama(TINY, tokenizer, max_positions=64)
    other.resize_token_embeddings(len(tokenizer) + 8)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="vocabulary"):
        load_draft(tmp_path / "other", target)


def test_train_draft_command_trains_a_saved_draft_further_and_installs_it(tmp_path, tokenizer):
    """`opttree train draft --init DIR --install-dir OUT`: the packed draft in OUT/draft unpacks to the trained
    one, and OUT/metrics.json's draft entries are replaced while the target's stay."""
    import json

    from opttree.shipped import unpack_file
    from opttree.train.cli import main

    corpus = tmp_path / "corpus"
    for name in ("alpha", "beta", "json"):  # json: a held-out module
        (corpus / name).mkdir(parents=True)
        (corpus / name / "__init__.py").write_text(CODE * 6)
    torch.manual_seed(0)
    save_final(build_llama(ModelShape(64, 2, 2, 128), tokenizer, max_positions=64), tokenizer, tmp_path / "target")
    save_final(build_llama(ModelShape(48, 1, 2, 96), tokenizer, max_positions=64), tokenizer, tmp_path / "draft")
    out = tmp_path / "models"
    out.mkdir()
    (out / "metrics.json").write_text(json.dumps({"target_heldout_loss": 1.5, "draft_heldout_kl": 9.0}))
    main(["train", "draft", "--target", str(tmp_path / "target"), "--init", str(tmp_path / "draft"), "--run-dir",
          str(tmp_path / "run"), "--steps", "3", "--seq-len", "32", "--eval-windows", "2", "--corpus", str(corpus),
          "--no-bf16", "--install-dir", str(out)])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["target_heldout_loss"] == 1.5 and metrics["draft_heldout_kl"] != 9.0
    assert metrics["draft_trained_further_steps"] == 3
    manifest = json.loads((out / "draft" / "packed.json").read_text())
    unpack_file(out / "draft" / "model.safetensors.xz", manifest["model.safetensors"], tmp_path / "unpacked")
    assert (tmp_path / "unpacked").read_bytes() == (tmp_path / "run" / "final" / "model.safetensors").read_bytes()


def test_train_draft_command_self_distils_on_text_the_target_writes(tmp_path, tokenizer):
    """`opttree train draft --texts N --corpus-share S`: the target writes N texts from corpus prompts (cached in
    RUN_DIR/data), the draft trains on them plus that share of corpus text and is scored on text the target wrote
    from held-out prompts; installed, metrics.json says it was trained on written texts."""
    import json

    from opttree.train.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("alpha", "beta", "gamma"):
        (corpus / f"{name}.py").write_text(CODE.replace("add", name) * 12)
    torch.manual_seed(0)
    save_final(build_llama(ModelShape(32, 2, 2, 64), tokenizer, max_positions=512), tokenizer, tmp_path / "target")
    save_final(build_llama(ModelShape(32, 1, 2, 64), tokenizer, max_positions=512), tokenizer, tmp_path / "draft")
    out = tmp_path / "models"
    out.mkdir()
    main(["train", "draft", "--target", str(tmp_path / "target"), "--init", str(tmp_path / "draft"), "--run-dir",
          str(tmp_path / "run"), "--texts", "4", "--corpus-share", "0.5", "--steps", "2", "--seq-len", "32",
          "--eval-windows", "2", "--corpus", str(corpus), "--heldout-modules", "gamma", "--no-bf16",
          "--install-dir", str(out)])
    written = np.load(tmp_path / "run" / "data" / "written_train.npy")
    eos = tokenizer.eos_token_id
    assert (written == eos).sum() >= 4 and written[-1] == eos  # four texts (and their prompts), each ended
    assert (tmp_path / "run" / "data" / "written_heldout.npy").exists()
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["draft_trained_further_on_written_texts"] == 4 and metrics["draft_trained_further_steps"] == 2


def test_distill_loss_is_zero_for_identical_models(tokenizer, tokens):
    torch.manual_seed(0)
    model = build_llama(TINY, tokenizer, max_positions=64).eval()
    batch = torch.from_numpy(tokens[:66].astype(np.int64)).view(2, 33)
    loss, logs = make_distill_loss(model, ce_weight=0.0)(model, batch)
    assert loss.item() == pytest.approx(0.0, abs=1e-5)
    assert logs["ce"] > 0


def test_cli_registers_train_subcommands():
    from opttree.train.cli import cmd_pair, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", "pair", "--out", "x", "--minutes-target", "2", "--minutes-draft", "1"])
    assert args.func is cmd_pair and args.minutes_target == 2.0 and args.minutes_draft == 1.0
    args = parser.parse_args(["train", "lm", "--tokenizer", "t", "--run-dir", "r", "--steps", "5", "--resume"])
    assert args.steps == 5 and args.resume and args.shape is None
    with pytest.raises(ValueError):
        ModelShape.parse("512,8,8")


def test_train_early_exit_and_length_predictor_commands_save_what_generation_loads(tmp_path, tokenizer):
    """`opttree train early-exit` and `opttree train length-predictor` end to end on a tiny target: each
    saves a folder that `opttree.generate` loads, and the output stays the target's own."""
    import json

    import opttree
    from opttree.cli import main
    from opttree.train.distill import load_target
    from opttree.train.lm import save_final

    torch.manual_seed(0)
    save_final(build_llama(ModelShape(hidden=32, layers=2, heads=2, intermediate=64), tokenizer, max_positions=512),
               tokenizer, tmp_path / "target")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("alpha", "beta", "gamma"):
        (corpus / f"{name}.py").write_text(CODE.replace("add", name) * 12)
    data = ["--corpus", str(corpus), "--heldout-modules", "gamma"]
    target_dir = str(tmp_path / "target")
    assert main(["train", "early-exit", "--target", target_dir, "--layers", "1", "--run-dir", str(tmp_path / "ee"),
                 "--texts", "4", "--steps", "3", "--seq-len", "32", "--eval-windows", "2", "--no-bf16", *data]) == 0
    assert main(["train", "length-predictor", "--target", target_dir, "--run-dir", str(tmp_path / "len"),
                 "--drafter", "early-exit", "--early-exit", str(tmp_path / "ee" / "final"), "--budget", "4",
                 "--max-depth", "3", "--prompts", "4", "--prompt-len", "16", "--new-tokens", "12", "--epochs", "2",
                 *data]) == 0
    metrics = json.loads((tmp_path / "len" / "final" / "metrics.json").read_text())
    assert metrics["steps"] > 0 and 0 <= metrics["accuracy"] <= 1
    target = load_target(tmp_path / "target")
    prompt = torch.tensor([tokenizer(CODE)["input_ids"][:10]])
    out = opttree.generate(target, prompt, drafter="early-exit", early_exit=tmp_path / "ee" / "final",
                           depth_control="predictor", length_predictor=tmp_path / "len" / "final", max_new_tokens=12,
                           eos_token_id=[])
    with torch.inference_mode():
        expected = target.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0,
                                   attention_mask=torch.ones_like(prompt))
    assert torch.equal(out.sequences, expected)
