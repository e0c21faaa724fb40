"""The shipped pair loads from inside the package and decodes exactly (fp32)."""

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
