"""Run by tests/test_parallel.py under `torchrun --nproc-per-node 2`: the shipped target sharded over the
ranks (transformers' tensor parallelism, gloo), against the unsharded target on the same rank.
Writes OUT/rank<R>.json with what each rank saw."""

import json
import sys
from pathlib import Path

import torch

import opttree
from opttree import parallel
from opttree.demo import demo_paths, load_model
from opttree.errors import RanksDiverged

PROMPTS = ["def fibonacci(n):\n", "import os\n\nclass Config:\n"]
NEW = 40
METHODS = {  # name -> (settings, whether the draft model drafts)
    "ar": (dict(tree="ar"), False),
    "opt": (dict(tree="opt", budget=8), True),
    "opt:recycling+lookup": (dict(tree="opt", drafter="recycling+lookup", budget=8), False),
    "opt:head": (dict(tree="opt", drafter="head", budget=8), False),
}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    parallel.start(torch.device("cpu"))
    target_path, draft_path = demo_paths()
    _, _, tok = opttree.demo_models(torch.float32)
    sharded = load_model(target_path, torch.float32, tp_plan="auto")
    whole = load_model(target_path, torch.float32)
    draft = load_model(draft_path, torch.float32)
    seen = {"rank": parallel.rank(), "sharded": parallel.sharded(sharded), "greedy": {}, "reference": {}}
    for i, prompt in enumerate(PROMPTS):
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.inference_mode():
            ref = whole.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
        seen["reference"][i] = ref[0, ids.shape[1]:].tolist()
        for name, (settings, with_draft) in METHODS.items():
            out_ = opttree.generate(sharded, ids, draft if with_draft else None, max_new_tokens=NEW, **settings)
            seen["greedy"][f"{name}/{i}"] = out_.new_tokens.tolist()
    ids = tok(PROMPTS[0], return_tensors="pt", add_special_tokens=False).input_ids
    sampled = dict(max_new_tokens=NEW, temperature=1.0, tree="opt", budget=8)
    seen["sampled"] = opttree.generate(sharded, ids, draft, seed=11, **sampled).new_tokens.tolist()
    try:  # each rank its own seed: the ranks part ways, and every rank must say so
        opttree.generate(sharded, ids, draft, seed=100 + parallel.rank(), **sampled)
        seen["diverged"] = None
    except RanksDiverged as err:
        seen["diverged"] = str(err)
    (out / f"rank{parallel.rank()}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
