"""EAGLE's claim, checked on our pair: does a feature head (or the target's own first layers with an
EESD exit layer) agree with the target more often than a separate draft LM of similar cost? Top-1
agreement with the target on the same held-out text the target wrote (RUN_DIR/data/written_heldout.npy
from `opttree train head`), plus trained parameters and the cost of one drafting call (one token on
top of a 200-token cache), all in float32.

    python scripts/head_vs_draft.py --run-dir runs/head [--head DIR] [--early-exit DIR] [--windows 32]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from opttree.demo import demo_paths
from opttree.step.cache import cache_argument, truncate
from opttree.step.drafters.head import DraftLMHead, load_head
from opttree.train.distill import load_target
from opttree.train.head import held_out_acceptance
from opttree.train.lm import eval_windows, n_params


@torch.no_grad()
def draft_agreement(target, draft, windows: torch.Tensor, batch: int = 8, skip: int = 3) -> float:
    """Top-1 agreement at the positions the head's figures score (from `skip` on: its three passes)."""
    agree = count = 0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        t, d = target(input_ids=w).logits.argmax(-1)[:, skip:], draft(input_ids=w).logits.argmax(-1)[:, skip:]
        agree, count = agree + int((t == d).sum()), count + t.numel()
    return agree / count


@torch.no_grad()
def call_ms(step, repeats: int = 30) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, default=Path("runs/head"))
    parser.add_argument("--head", type=Path, default=None, help="default: RUN_DIR/final")
    parser.add_argument("--early-exit", type=Path, default=None, help="an exit layer folder, compared too")
    parser.add_argument("--windows", type=int, default=32)
    args = parser.parse_args()
    target_dir, draft_dir = demo_paths()
    target, draft = load_target(target_dir), load_target(draft_dir)
    head = load_head(args.head or args.run_dir / "final", target).float()
    windows = eval_windows(np.load(args.run_dir / "data" / "written_heldout.npy"), 256, args.windows)
    from transformers import DynamicCache

    ids = windows[:1, :200]
    cache = DynamicCache()
    draft(input_ids=ids, **{cache_argument(draft): cache})
    one = ids[:, -1:]

    def draft_step():  # as ModelDrafter: the draft's logits -> log-probabilities
        torch.log_softmax(draft(input_ids=one, **{cache_argument(draft): cache}).logits.float(), dim=-1)
        truncate(cache, 200)

    hidden = target.config.hidden_size
    drafted = DraftLMHead(target.get_output_embeddings(), target.config.vocab_size, head.draft_vocab)
    head_cache = DynamicCache()
    features, embeds = torch.zeros(1, 200, len(head.layers) * hidden), target.get_input_embeddings()(ids)
    head(features, embeds, torch.arange(200)[None], torch.ones(200, 200, dtype=torch.bool).tril(), head_cache)

    def head_step():  # a tree node: it reads its parent's output (H wide), not the target's fused layers
        f = head(features[:, -1:, :hidden], embeds[:, -1:], torch.tensor([[200]]), torch.ones(1, 201, dtype=torch.bool),
                 head_cache, own=True)
        drafted(f)  # the target's LM head (over the head's draft vocabulary) -> log-probabilities
        truncate(head_cache, 200)

    result = {
        "windows": f"{len(windows)} x 256 tokens the target wrote from held-out prompts",
        "draft": {"params": n_params(draft), "top1": draft_agreement(target, draft, windows),
                  "call_ms": call_ms(draft_step)},
        "head": {"params": n_params(head), **held_out_acceptance(head, target, windows), "call_ms": call_ms(head_step)},
    }
    if args.early_exit:
        result["early_exit"] = early_exit_figures(target, args.early_exit, windows, ids)
    print(json.dumps(result, indent=1))


def early_exit_figures(target, folder: Path, windows: torch.Tensor, ids: torch.Tensor) -> dict:
    """The exit layer's agreement, and one drafting call: the target's first L layers over one token on top
    of their 200-token cache, the exit layer on its own 200-token cache, the LM head."""
    from transformers import DynamicCache

    from opttree.step.drafters.early_exit import load_early_exit
    from opttree.train.early_exit import held_out_acceptance as exit_acceptance

    exit_layer = load_early_exit(folder, target).float()
    lower, exit_cache = DynamicCache(), DynamicCache()
    states = exit_layer.lower(input_ids=ids, **{cache_argument(exit_layer.lower): lower},
                              use_cache=True).last_hidden_state
    exit_layer(states, torch.arange(200)[None], torch.ones(200, 200, dtype=torch.bool).tril(), exit_cache)
    one, position, allowed = ids[:, -1:], torch.tensor([[200]]), torch.ones(1, 201, dtype=torch.bool)

    def exit_step():
        state = exit_layer.lower(input_ids=one, position_ids=position, **{cache_argument(exit_layer.lower): lower},
                                 use_cache=True).last_hidden_state
        torch.log_softmax(target.get_output_embeddings()(exit_layer(state, position, allowed, exit_cache)), dim=-1)
        truncate(lower, 200), truncate(exit_cache, 200)

    return {"layers": exit_layer.exit_after, "params": n_params(exit_layer),
            **exit_acceptance(exit_layer, target, windows), "call_ms": call_ms(exit_step)}


if __name__ == "__main__":
    main()
