"""Every policy and every draft source at budgets 1, 16, 64 and 256: greedy output identical to the
target's own (fp32), never a crash (a lookup trie deeper than its table of hit rates shares the table's last
column: no IndexError at budgets past 16)."""

import pytest
import torch
from helpers import hf_greedy, tiny_model

import opttree
from opttree.step.drafters.early_exit import ExitLayer
from opttree.step.drafters.head import FeatureHead, head_config

BUDGETS = (1, 16, 64, 256)
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A looping target (lookup and recycling find long matches), a draft, an untrained head and exit
    layer, and a prompt whose greedy continuation is known."""
    target = tiny_model("llama", vocab=48, hidden=32, layers=2, seed=3, init=0.5)
    draft = tiny_model("llama", vocab=48, hidden=32, layers=1, seed=4, init=0.5)
    torch.manual_seed(0)
    parts = {"head": FeatureHead(head_config(target)).save(tmp_path_factory.mktemp("head"), target),
             "early_exit": ExitLayer(target, 1).save(tmp_path_factory.mktemp("exit"), target)}
    prompt = torch.randint(3, 48, (1, 30), generator=torch.Generator().manual_seed(1))
    return target, draft, parts, prompt, hf_greedy(target, prompt, NEW_TOKENS, eos_token_id=None)


CASES = ([(policy, "model+recycling+lookup") for policy in opttree.available_policies() if policy != "ar"]
         + [("opt", source) for source in ("model", "recycling", "lookup", "head", "early-exit")]
         + [("eagle2", "head+lookup"), ("dyspec", "early-exit+recycling")])


@pytest.mark.parametrize("tree,drafter", CASES)
def test_every_policy_and_source_is_exact_at_every_budget(setup, tree, drafter):
    target, draft, parts, prompt, expected = setup
    options = {name: folder for name, folder in parts.items() if name.replace("_", "-") in drafter}
    for budget in BUDGETS:
        out = opttree.generate(target, prompt, draft if "model" in drafter else None, tree=tree, drafter=drafter,
                               budget=budget, max_new_tokens=NEW_TOKENS, eos_token_id=[], **options)
        assert torch.equal(out.sequences, expected), (tree, drafter, budget)
        assert out.stats.steps <= NEW_TOKENS
