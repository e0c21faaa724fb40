"""``opttree train``: build the shipped model pair from the stdlib source (tokenizer, lm, draft, pair), the
parts that read a target (head, early-exit, length-predictor) and a GPU testbed (inflate).

The main CLI calls :func:`register`; ``python -m opttree.train.cli train ...`` works stand-alone.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

# Training runs long, often beside other work: it waits passively (threads.py has the measurements). Set
# here for `python -m opttree.train.cli ...` (before torch is imported); `opttree train` sets it in the main CLI.
# Importing this module must not: the main CLI imports it for every command.
if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ..flags import add_trained_part_args  # noqa: E402 (no torch import)
from ..settings.names import TRAINED_SOURCES  # noqa: E402

DEFAULT_INSTALL_DIR = Path(__file__).resolve().parents[1] / "models"


def _log(msg: str) -> None:
    print(msg, flush=True)


def _add_corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", type=Path, default=None,
                   help="root of *.py files (default: this Python's stdlib source)")
    p.add_argument("--heldout-modules", default=None,
                   help="comma-separated top-level names held out (default: opttree.train.corpus.HELDOUT_MODULES)")


def _add_train_args(p: argparse.ArgumentParser, lr: float, batch_size: int) -> None:
    p.add_argument("--run-dir", type=Path, required=True, help="checkpoints, logs, and final/ go here")
    p.add_argument("--shape", default=None, help="hidden,layers,heads,intermediate")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=None, help="step budget")
    p.add_argument("--minutes", type=float, default=None, help="wall-clock budget (schedule follows it)")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--ckpt-minutes", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 instead of bf16 autocast")
    p.add_argument("--resume", action="store_true", help="continue from run-dir/ckpt.pt if present")
    p.add_argument("--cache-dir", type=Path, default=None, help="encoded-corpus cache (default: run-dir/data)")
    _add_corpus_args(p)


def _train_config(args, steps=None, minutes=None, run_dir=None, resume=None):
    from .lm import TrainConfig

    return TrainConfig(run_dir=run_dir or args.run_dir, seq_len=args.seq_len, batch_size=args.batch_size,
                       lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
                       grad_clip=args.grad_clip, steps=steps if steps is not None else args.steps,
                       minutes=minutes if minutes is not None else args.minutes, eval_every=args.eval_every,
                       eval_windows=args.eval_windows, ckpt_minutes=args.ckpt_minutes, seed=args.seed,
                       bf16=_bf16_autocast(args), resume=args.resume if resume is None else resume)


def _bf16_autocast(args) -> bool:
    """bf16 autocast unless --no-bf16, and only where the CPU has bf16 instructions: restricted to AVX2 a
    bf16 training step measured 20x slower than fp32 (82 s against 4.0 s, `train head`, 2-core EPYC)."""
    from ..hardware import bf16_hardware

    if args.no_bf16:
        return False
    if not bf16_hardware():
        _log("training in float32: this CPU has no bf16 instructions (bf16 autocast would be ~20x slower)")
        return False
    return True


def _heldout(args) -> tuple[str, ...]:
    from .corpus import HELDOUT_MODULES

    return tuple(args.heldout_modules.split(",")) if args.heldout_modules else HELDOUT_MODULES


def _tokens(tokenizer, args, cache_dir: Path):
    from .corpus import load_or_encode

    t0 = time.perf_counter()
    train = load_or_encode(tokenizer, args.corpus, "train", cache_dir, _heldout(args))
    heldout = load_or_encode(tokenizer, args.corpus, "heldout", cache_dir, _heldout(args))
    _log(f"corpus: {len(train):,} train tokens, {len(heldout):,} held-out tokens "
         f"({100 * len(heldout) / (len(train) + len(heldout)):.1f}%), {time.perf_counter() - t0:.0f}s")
    return train, heldout


def cmd_tokenizer(args) -> None:
    from .corpus import load_texts
    from .tokenizer import train_tokenizer

    t0 = time.perf_counter()
    texts = load_texts(args.corpus, "train", _heldout(args))
    tok = train_tokenizer(texts, args.vocab_size, args.out)
    _log(f"tokenizer: {len(tok)} tokens from {len(texts)} train files -> {args.out} "
         f"({time.perf_counter() - t0:.0f}s)")


def cmd_lm(args) -> None:
    from .lm import TARGET_SHAPE, ModelShape, train_lm
    from .tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    train, heldout = _tokens(tok, args, args.cache_dir or args.run_dir / "data")
    shape = ModelShape.parse(args.shape) if args.shape else TARGET_SHAPE
    _, metrics = train_lm(tok, train, heldout, shape, _train_config(args), _log)
    _log(f"saved {args.run_dir / 'final'}: {json.dumps(metrics)}")


def cmd_draft(args) -> None:
    from .distill import load_target, train_draft
    from .lm import DRAFT_SHAPE, ModelShape
    from .tokenizer import load_tokenizer

    tok = load_tokenizer(args.target)
    target = load_target(args.target)
    train, heldout = _tokens(tok, args, args.cache_dir or args.run_dir / "data")
    # self-distilled: on the target's own text
    written = _written(target, tok, args, (train, heldout)) if args.texts else None
    if written is not None:
        train = written["train"]
    shape = ModelShape.parse(args.shape) if args.shape else DRAFT_SHAPE
    if args.init is not None and args.shape:
        raise SystemExit("--init trains a saved draft further: its shape is its own, drop --shape")
    _, metrics = train_draft(target, tok, train, heldout if written is None else written["heldout"], shape,
                             _train_config(args), args.ce_weight, _log, init=args.init)
    _log(f"saved {args.run_dir / 'final'}: {json.dumps(metrics)}")
    if args.install_dir is not None:
        _install_draft(args, metrics, heldout)


def _install_draft(args, run: dict, heldout) -> None:
    """The trained draft replaces DIR/draft (packed), and DIR/metrics.json's draft entries are measured again
    on the held-out split (the pair's evaluation: 256 windows); how it was trained is added to them. One-token
    latencies are written only where the file has none (they are the pair's, timed together)."""
    from ..shipped import pack_folder

    out = Path(args.install_dir)
    metrics = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else {}
    pair = evaluate_shipped(args.target, args.run_dir / "final", heldout, args.seq_len, 256)
    metrics.update({k: v for k, v in pair.items() if k.startswith("draft_") or k == "heldout_tokens_evaluated"})
    if "one_token_latency_prefix200" not in metrics:  # the pair's are kept: timed with the target, on one machine
        metrics["one_token_latency_prefix200"] = pair["one_token_latency_prefix200"]
    key = "draft_trained_further" if args.init is not None else "draft_train"
    metrics[f"{key}_minutes"] = round(run.get("elapsed_min", 0.0), 2)
    metrics[f"{key}_steps"] = run.get("step")
    metrics[f"{key}_tokens_seen"] = run.get("tokens_seen") or run.get("step", 0) * args.batch_size * args.seq_len
    metrics[f"{key}_on_written_texts"] = args.texts  # 0: on the corpus
    pack_folder(args.run_dir / "final", out / "draft")  # weights lzma-packed, unpacked on first use
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    _log(f"installed the draft into {out / 'draft'} (packed); {out / 'metrics.json'} updated")


def _written(target, tok, args, tokens: tuple | None = None) -> dict:
    """{"train", "heldout"}: text the target wrote from corpus prompts (cached in RUN_DIR/data); with
    --corpus-share S, the training text is that share corpus text after the written text (the held-out
    text stays the target's). `tokens`: the corpus's (train, heldout) tokens, when the caller has them."""
    import numpy as np

    from .head import written_text

    data = args.run_dir / "data"
    train, heldout = tokens if tokens is not None else _tokens(tok, args, data)
    written = {}
    for split, corpus, texts in (("train", train, args.texts), ("heldout", heldout, max(args.texts // 12, min(args.texts, 16)))):
        cache = data / f"written_{split}.npy"
        if not cache.exists():
            t0 = time.perf_counter()
            tokens = written_text(target, corpus, texts, tok.eos_token_id, seed=args.seed + (split == "heldout"))
            cache.parent.mkdir(parents=True, exist_ok=True)
            np.save(cache, tokens)
            _log(f"the target wrote {texts} {split} texts, {len(tokens):,} tokens, in {time.perf_counter() - t0:.0f}s")
        written[split] = np.load(cache)
    if args.corpus_share:
        if not 0 < args.corpus_share < 1:
            raise SystemExit(f"--corpus-share must be in (0, 1), got {args.corpus_share}")
        extra = min(len(train), round(len(written["train"]) * args.corpus_share / (1 - args.corpus_share)))
        written["train"] = np.concatenate([written["train"], train[:extra]])
        _log(f"training text: {len(written['train']) - extra:,} written + {extra:,} corpus tokens")
    return written


def _self_distilled(sub, name: str, what: str) -> argparse.ArgumentParser:
    """The parser of a part trained on text the target writes (head, early-exit): its common flags."""
    p = sub.add_parser(name, help=f"{what}, self-distilled on text the target writes")
    p.add_argument("--target", type=Path, required=True, help="target model dir (with tokenizer)")
    p.add_argument("--out", type=Path, default=None, help="where it is saved (default: RUN_DIR/final)")
    p.add_argument("--texts", type=int, default=256, help="texts the target writes for training (default: 256)")
    p.add_argument("--corpus-share", type=float, default=0.0, help="share of corpus text (labelled by the target "
                   "like the written text) in the training text, in [0, 1) (default: 0, written text only)")
    return p


def cmd_head(args) -> None:
    """A feature head for --target: the target writes the training text, the head learns its features."""
    from dataclasses import replace

    from .distill import load_target
    from .head import RECIPES, train_head
    from .tokenizer import load_tokenizer

    target = load_target(args.target)
    written = _written(target, load_tokenizer(args.target), args)
    out = args.out or args.run_dir / "final"
    recipe = RECIPES[args.recipe]
    if args.layers:
        recipe = replace(recipe, layers=tuple(int(i) for i in args.layers.split(",")))
    _, metrics = train_head(target, written["train"], written["heldout"], _train_config(args), out, recipe,
                            args.draft_vocab, _log)
    _log(f"saved {out}: {json.dumps(metrics)}")


def cmd_early_exit(args) -> None:
    """An EESD exit layer after the target's first --layers layers, self-distilled on text the target writes."""
    from .distill import load_target
    from .early_exit import train_early_exit
    from .tokenizer import load_tokenizer

    target = load_target(args.target)
    written = _written(target, load_tokenizer(args.target), args)
    out = args.out or args.run_dir / "final"
    _, metrics = train_early_exit(target, args.layers, written["train"], written["heldout"], _train_config(args),
                                  out, _log)
    _log(f"saved {out}: {json.dumps(metrics)}")


def cmd_length(args) -> None:
    """AdaEAGLE's length predictor for --target: logged fixed-depth runs, then a small MLP fitted to them."""
    import numpy as np
    import torch

    from .distill import load_target
    from .length import fit_length_predictor, logged_steps, save_predictor
    from .tokenizer import load_tokenizer

    tok = load_tokenizer(args.target)
    target = load_target(args.target)
    draft = load_target(args.draft) if args.draft else None
    train, heldout = _tokens(tok, args, args.run_dir / "data")
    drafter = args.drafter or ("model" if draft is not None else "recycling+lookup")
    options = dict(tree=args.tree, drafter=drafter, budget=args.budget, max_depth=args.max_depth,
                   max_new_tokens=args.new_tokens, temperature=args.temperature, eos_token_id=tok.eos_token_id,
                   **{option: getattr(args, option) for option in TRAINED_SOURCES.values() if getattr(args, option)})
    rng = np.random.default_rng(args.seed)
    logged = {}
    for split, corpus, count in (("train", train, args.prompts), ("heldout", heldout, max(args.prompts // 4, 8))):
        cache = args.run_dir / f"steps_{split}.pt"
        if not cache.exists():
            starts = rng.integers(0, len(corpus) - args.prompt_len, count)
            prompts = [torch.from_numpy(corpus[s : s + args.prompt_len].astype(np.int64)) for s in starts]
            t0 = time.perf_counter()
            steps = logged_steps(target, draft, prompts, options, f"{split} runs")
            torch.save(steps, cache)
            _log(f"{split}: {count} prompts, {steps['accepted'].numel():,} steps logged in "
                 f"{time.perf_counter() - t0:.0f}s (mean accepted {steps['accepted'].float().mean():.2f})")
        logged[split] = torch.load(cache)
    t0 = time.perf_counter()
    predictor, metrics = fit_length_predictor(target, logged["train"], logged["heldout"], args.max_depth,
                                              epochs=args.epochs, seed=args.seed, log=_log)
    metrics = {**metrics, "fit_s": round(time.perf_counter() - t0, 1),
               "params": sum(p.numel() for p in predictor.parameters())}
    out = args.out or args.run_dir / "final"
    save_predictor(predictor, target, out, about={"metrics": metrics, "logged_with": {
        k: v for k, v in options.items() if k not in ("eos_token_id",)}})
    _log(f"saved {out}: {json.dumps(metrics)}")


def one_token_latency_ms(model, dtype, prefix: int = 200, repeats: int = 30) -> float:
    """Median wall time of a one-token forward on top of a ``prefix``-token DynamicCache."""
    import copy

    import torch
    from transformers import DynamicCache

    from ..step.cache import cache_argument

    m = copy.deepcopy(model).to(dtype).eval()
    ids = torch.randint(0, m.config.vocab_size, (1, prefix), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.no_grad():
        cache = DynamicCache(config=m.config)
        m(input_ids=ids, use_cache=True, **{cache_argument(m): cache})
        x, pos = ids[:, -1:], torch.tensor([[prefix]])
        for _ in range(repeats):
            t0 = time.perf_counter()
            m(input_ids=x, position_ids=pos, **{cache_argument(m): cache}, use_cache=True)
            times.append(time.perf_counter() - t0)
            cache.crop(-1)  # back to the prefix
    return 1000 * sorted(times)[len(times) // 2]


def evaluate_shipped(target_dir: Path, draft_dir: Path, heldout_tokens, seq_len: int, n_windows: int) -> dict:
    """Metrics of the saved (bf16-weight) pair, loaded as fp32 and run under bf16 autocast."""
    import torch

    from .distill import evaluate_pair, load_target
    from .lm import eval_windows, evaluate_lm, n_params

    target, draft = load_target(target_dir), load_target(draft_dir)
    windows = eval_windows(heldout_tokens, seq_len, n_windows)
    t = evaluate_lm(target, windows)
    d = evaluate_pair(target, draft, windows)
    lat = {f"{name}_{dt}_ms": round(one_token_latency_ms(m, getattr(torch, dt)), 3)
           for name, m in (("target", target), ("draft", draft)) for dt in ("float32", "bfloat16")}
    return {"heldout_tokens_evaluated": int(windows[:, 1:].numel()),
            "target_params": n_params(target), "draft_params": n_params(draft),
            "target_heldout_loss": t["heldout_loss"], "target_heldout_ppl": t["heldout_ppl"],
            "draft_heldout_loss": d["heldout_loss"], "draft_heldout_ppl": d["heldout_ppl"],
            "draft_heldout_kl": d["heldout_kl"], "draft_top1_agreement": d["top1_agreement"],
            "one_token_latency_prefix200": lat}


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def cmd_pair(args) -> None:
    """tokenizer -> target -> draft -> evaluation -> install; every stage resumes or is skipped if done."""
    from .corpus import load_texts
    from .distill import load_target, train_draft
    from .lm import DRAFT_SHAPE, TARGET_SHAPE, ModelShape, train_lm
    from .tokenizer import load_tokenizer, train_tokenizer

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.install_dir is not None:
        _log(f"note: at the end the trained pair REPLACES the models in {args.install_dir} (--no-install or "
             f"--install-dir DIR to keep them); budget {args.minutes_target:g} + {args.minutes_draft:g} minutes "
             "of training (the shipped pair was trained 58 + 18 minutes on 2 cores)")
    t_start = time.perf_counter()
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        _log("== tokenizer")
        train_tokenizer(load_texts(args.corpus, "train", _heldout(args)), args.vocab_size, tok_dir)
    tok = load_tokenizer(tok_dir)
    train, heldout = _tokens(tok, args, out / "data")

    target_dir = out / "target"
    if not (target_dir / "final" / "model.safetensors").exists():
        _log("== target")
        cfg = _train_config(args, steps=args.steps_target, minutes=args.minutes_target, run_dir=target_dir,
                            resume=True)  # the pair command is always restartable
        cfg.lr, cfg.batch_size = args.lr_target, args.batch_size_target
        train_lm(tok, train, heldout, ModelShape.parse(args.target_shape) if args.target_shape else TARGET_SHAPE,
                 cfg, _log)
    draft_dir = out / "draft"
    if not (draft_dir / "final" / "model.safetensors").exists():
        _log("== draft")
        cfg = _train_config(args, steps=args.steps_draft, minutes=args.minutes_draft, run_dir=draft_dir, resume=True)
        cfg.lr, cfg.batch_size = args.lr_draft, args.batch_size_draft
        train_draft(load_target(target_dir / "final"), tok, train, heldout,
                    ModelShape.parse(args.draft_shape) if args.draft_shape else DRAFT_SHAPE, cfg,
                    args.ce_weight, _log)

    _log("== evaluation of the saved pair")
    metrics = evaluate_shipped(target_dir / "final", draft_dir / "final", heldout, args.seq_len,
                               args.final_eval_windows)
    for name, d in (("target", target_dir), ("draft", draft_dir)):
        run = json.loads((d / "final_metrics.json").read_text())
        metrics[f"{name}_train_minutes"] = round(run.get("elapsed_min", 0.0), 2)
        metrics[f"{name}_train_steps"] = run.get("step")
        metrics[f"{name}_train_tokens_seen"] = run.get("tokens_seen")
        metrics[f"{name}_shape"] = run.get("shape")
    metrics["corpus_train_tokens"], metrics["corpus_heldout_tokens"] = int(len(train)), int(len(heldout))
    metrics["heldout_modules"] = list(_heldout(args))
    metrics["pair_command_minutes_this_invocation"] = round((time.perf_counter() - t_start) / 60, 2)
    metrics["size_bytes"] = _dir_size(target_dir / "final") + _dir_size(draft_dir / "final")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    _log(json.dumps(metrics, indent=2))

    if args.install_dir is not None:
        from ..shipped import pack_folder

        for name, d in (("target", target_dir), ("draft", draft_dir)):
            pack_folder(d / "final", Path(args.install_dir) / name)  # weights lzma-packed, unpacked on first use
        (Path(args.install_dir) / "metrics.json").write_text(json.dumps(metrics, indent=2))
        _log(f"installed target and draft into {args.install_dir} (packed)")


def cmd_inflate(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .inflate import inflate

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32, local_files_only=True)
    big = inflate(model, args.hidden, args.intermediate, args.layers, device=args.device).to(dtypes[args.dtype])
    big.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.target).save_pretrained(args.out)
    params = sum(p.numel() for p in big.parameters())
    _log(f"saved {args.out}: {params / 1e9:.2f}B parameters ({args.dtype}), the function of {args.target}")


def register(subparsers) -> None:
    """Add ``train`` and its subcommands to an argparse subparsers object."""
    train = subparsers.add_parser(
        "train", help="train models: tokenizer, lm, draft, head, early-exit, length-predictor, pair, inflate",
        description="Train a tokenizer, a target LM and its draft (or the whole shipped pair at once), a draft "
        "part that reads a target (feature head, early-exit layer), a draft length predictor, or inflate a "
        "target for GPU tests. `opttree train COMMAND --help` describes each.")
    sub = train.add_subparsers(dest="train_command", required=True)

    p = sub.add_parser("tokenizer", help="byte-level BPE on the corpus' train split")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=8192)
    _add_corpus_args(p)
    p.set_defaults(func=cmd_tokenizer)

    p = sub.add_parser("lm", help="pretrain a Llama target from scratch")
    p.add_argument("--tokenizer", type=Path, required=True)
    _add_train_args(p, lr=1e-3, batch_size=8)
    p.set_defaults(func=cmd_lm)

    p = sub.add_parser("draft", help="distil a small Llama draft from a target")
    p.add_argument("--target", type=Path, required=True, help="target model dir (with tokenizer)")
    p.add_argument("--ce-weight", type=float, default=0.1, help="weight of next-token CE vs KL")
    p.add_argument("--init", type=Path, default=None, help="a saved draft (model dir) to train further instead of "
                   "a fresh one, e.g. \"$(opttree models --path draft)\"")
    p.add_argument("--install-dir", type=Path, default=None, help="then replace DIR/draft with it (packed) and "
                   "update DIR/metrics.json's draft entries, e.g. src/opttree/models (default: install nothing)")
    p.add_argument("--texts", type=int, default=0, help="self-distil: train on N texts the target writes from corpus "
                   "prompts (sampled at 0.8), instead of the corpus itself (default: 0, the corpus)")
    p.add_argument("--corpus-share", type=float, default=0.0, help="with --texts: share of corpus text in the "
                   "training text, in [0, 1) (default: 0)")
    _add_train_args(p, lr=2e-3, batch_size=8)
    p.set_defaults(func=cmd_draft)

    p = _self_distilled(sub, "head", "an EAGLE-style feature head for a target (drafter 'head')")
    p.add_argument("--recipe", choices=["eagle3", "eagle1"], default="eagle3",
                   help="eagle3: fused low/middle/last layers, distribution loss, 3-pass training-time test; eagle1: "
                   "the last layer, feature regression + 0.1 x distribution loss, 2 passes (default: eagle3)")
    p.add_argument("--layers", default=None, help="the target's hidden_states the head reads, comma-separated "
                   "(0 = embeddings, -1 = the last layer; default: the recipe's)")
    p.add_argument("--draft-vocab", type=int, default=0, help="draft only the N token ids most frequent in the "
                   "training text, as EAGLE-3 does: a cheaper LM head per drafting call (default: 0, all)")
    _add_train_args(p, lr=1e-3, batch_size=8)
    p.set_defaults(func=cmd_head, seq_len=256, eval_every=100, eval_windows=32)

    p = _self_distilled(sub, "early-exit", "an EESD exit layer after the target's first L layers (drafter 'early-exit')")
    p.add_argument("--layers", type=int, required=True, help="draft with the target's first L layers")
    _add_train_args(p, lr=5e-4, batch_size=8)
    p.set_defaults(func=cmd_early_exit, seq_len=256, eval_every=100, eval_windows=32)

    p = sub.add_parser("length-predictor", help="AdaEAGLE's draft length predictor (--depth-control predictor), "
                       "fitted to accepted lengths logged from fixed-depth runs")
    p.add_argument("--target", type=Path, required=True, help="target model dir (with tokenizer)")
    p.add_argument("--draft", type=Path, default=None, help="draft model dir, for drafters with 'model'")
    p.add_argument("--drafter", default=None, help="draft sources of the logged runs (default: model with --draft, "
                   "else recycling+lookup)")
    add_trained_part_args(p)
    p.add_argument("--tree", default="opt", help="tree policy of the logged runs (default: opt)")
    p.add_argument("--budget", type=int, default=16, help="draft nodes per step (default: 16)")
    p.add_argument("--max-depth", type=int, default=8, help="the fixed depth D of the logged runs; the predictor "
                   "predicts 0..D accepted tokens (default: 8)")
    p.add_argument("--temperature", type=float, default=0.0, help="of the logged runs (default: 0)")
    p.add_argument("--prompts", type=int, default=160, help="training prompts (held-out: a quarter as many)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=96, help="tokens generated per prompt (default: 96)")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--run-dir", type=Path, required=True, help="logged steps and final/ go here")
    p.add_argument("--out", type=Path, default=None, help="where the predictor is saved (default: RUN_DIR/final)")
    p.add_argument("--seed", type=int, default=0)
    _add_corpus_args(p)
    p.set_defaults(func=cmd_length)

    p = sub.add_parser("pair", help="tokenizer + target + draft + eval + install: reproduces the shipped pair "
                       "(the defaults train the target 70 and the draft 20 minutes, over 90 minutes in all; by default "
                       "REPLACES the shipped models: see --no-install)")
    p.add_argument("--out", type=Path, required=True, help="work dir (restartable)")
    p.add_argument("--minutes-target", type=float, default=70.0, help="the target's training budget (default: 70)")
    p.add_argument("--minutes-draft", type=float, default=20.0, help="the draft's training budget (default: 20)")
    p.add_argument("--steps-target", type=int, default=None)
    p.add_argument("--steps-draft", type=int, default=None)
    p.add_argument("--target-shape", default=None, help="hidden,layers,heads,intermediate (default 512,8,8,1376)")
    p.add_argument("--draft-shape", default=None, help="hidden,layers,heads,intermediate (default 256,1,4,688)")
    p.add_argument("--lr-target", type=float, default=1e-3)
    p.add_argument("--lr-draft", type=float, default=2e-3)
    p.add_argument("--batch-size-target", type=int, default=8)
    p.add_argument("--batch-size-draft", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--ce-weight", type=float, default=0.1)
    p.add_argument("--final-eval-windows", type=int, default=256)
    p.add_argument("--install-dir", type=Path, default=DEFAULT_INSTALL_DIR,
                   help=f"copy final models to INSTALL_DIR/{{target,draft}} (default {DEFAULT_INSTALL_DIR})")
    p.add_argument("--no-install", dest="install_dir", action="store_const", const=None,
                   help="keep the shipped models: the trained pair stays in OUT/{target,draft}/final")
    _add_train_args(p, lr=1e-3, batch_size=8)
    p.set_defaults(func=cmd_pair)
    for action in p._actions:  # pair manages run dirs, budgets, lr and batch size per model itself
        if action.dest in ("run_dir", "steps", "minutes", "lr", "batch_size", "shape", "resume", "cache_dir"):
            action.required = False
            action.help = argparse.SUPPRESS

    p = sub.add_parser("inflate", help="widen and deepen a Llama target without changing its function "
                       "(a GPU testbed: the shipped target at a 1B model's cost)")
    p.add_argument("--target", type=Path, required=True, help="Llama model dir (with tokenizer)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--hidden", type=int, default=2048, help="hidden width (default: 2048)")
    p.add_argument("--intermediate", type=int, default=5632, help="MLP width (default: 5632)")
    p.add_argument("--layers", type=int, default=22, help="decoder layers (default: 22, ~1.1B parameters)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--device", default="cpu", help="where to build it (cuda is much faster for 1B)")
    p.set_defaults(func=cmd_inflate)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m opttree.train.cli")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
