"""Architecture sweep: every causal LM transformers ships, tiny, random, fp32. Each case is
token-identical to `target.generate(do_sample=False)` or refused by opttree with a clear error; never
a different output, never an error from inside the model.

Every architecture's outcomes are pinned: `SUBSET` (run by CI) and `EXPECTED` (the full sweep: an
architecture not listed there is identical in every case). A refusal counts only when its message names
a known reason (`REASONS`), and an architecture that could not be compared (not built, no reference,
not run) is listed with what stopped it (`CAUSES`). The full sweep (every architecture):
    OPTTREE_FULL_SWEEP=1 python -m pytest -q tests/test_architectures.py
and its counts by outcome, with the architectures whose outcomes differ from the pins:
    python tests/test_architectures.py
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from arch_configs import tiny, tiny_config
from helpers import hf_greedy, tiny_model
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import opttree

PROMPT = torch.tensor([[1, 5, 7, 9, 11, 13]])
NEW_TOKENS = 40  # 6 + 40 tokens: past the small windows and thresholds below
SMALL_WINDOWS = {"sliding_window": 16, "window_size": 16, "attention_chunk_size": 16,
                 "original_max_position_embeddings": 16}
BUDGETS = (1, 4, 16)
# The CI subset and the outcomes each architecture must give (all of its cases): a mainstream family that
# becomes refused, or a refusal that changes its reason, fails the test. gemma3_text and phi3 cover the
# windows and LongRoPE-free small-window variants; gpt_neo (its window crossed), mpt (ALiBi) and bart
# (positions from the cache length) run as chains, target and draft; tests/test_state_models.py covers the hybrids.
SUBSET = {"llama": {"identical"}, "gpt2": {"identical"}, "gemma3_text": {"identical"}, "phi3": {"identical"},
          "gpt_neo": {"identical"}, "mpt": {"identical"}, "bart": {"identical"}, "deepseek_v3": {"identical"},
          "mamba": {"identical"}}
# The full sweep's pins (`OPTTREE_FULL_SWEEP=1`; written by `python tests/test_architectures.py --pin`): the
# outcomes of every architecture that is not identical in every case, and what stopped the comparison where
# nothing was compared.
PINS = Path(__file__).with_name("architectures_pinned.json")
_PINNED = json.loads(PINS.read_text())
EXPECTED: dict[str, set[str]] = {name: set(kinds) for name, kinds in _PINNED["expected"].items()}
CAUSES: dict[str, str] = _PINNED["causes"]
# How a refusal's message names its reason (first match wins).
REASONS = {
    "ALiBi": "ALiBi", "cache length": "positions from the cache length", "hash buckets": "hash-bucketed attention (Reformer)",
    "several new tokens": "state restarted by a multi-token forward (Mamba)",
    "bidirectional": "bidirectional", "local-attention": "local window (GPT-Neo)",
    "rope_type=": "rope factors switched by length",
    "key rows": "key-index causal buffer", "layers of type": "non-attention layer types",
    "forward takes no": "no positioned KV cache", "exactness check": "failed the exactness probe",
    "attn_implementation": "attention implementation",
}


def outcome(target, draft, budget: int, reference: torch.Tensor, tree: str = "opt") -> str:
    """'identical', 'refused: <reason>', 'WRONG' or 'UNCLEAR ERROR: ...' for one generation."""
    try:
        out = opttree.generate(target, PROMPT, draft, tree=tree, budget=budget, max_new_tokens=NEW_TOKENS,
                               eos_token_id=2)
    except (ValueError, NotImplementedError) as error:  # a refusal counts only when it names a known reason
        reason = next((name for key, name in REASONS.items() if key in str(error)), None)
        return f"refused: {reason}" if reason else f"UNCLEAR REFUSAL: {str(error)[:120]}"
    except Exception as error:  # noqa: BLE001 - anything else is a failure of opttree's checks
        return f"UNCLEAR ERROR: {type(error).__name__}: {str(error)[:120]}"
    return "identical" if torch.equal(out.sequences, reference) else "WRONG"


def variants(model_type: str) -> list[dict]:
    """The default config, plus one with every window / threshold it has made small enough to cross.
    Raises what transformers raises when it cannot build the architecture's config small."""
    default = tiny_config(model_type)
    small = {k: v for k, v in SMALL_WINDOWS.items() if getattr(default.get_text_config(), k, None)}
    return [{}, small] if small else [{}]


def cause(error: Exception) -> str:
    """An exception as one short line, for an outcome that names why nothing was compared."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:100] if text else ''}"


def sweep_architecture(model_type: str) -> list[tuple[str, str]]:
    """[(case, outcome)] over attention implementations, config variants, drafts and budgets."""
    try:
        configs = variants(model_type)
    except Exception as error:  # noqa: BLE001 - transformers cannot build this architecture small
        return [(model_type, f"not built ({cause(error)})")]
    results, unbuilt = [], None
    for extra in configs:
        for attn in ("sdpa", "eager"):
            name = f"{model_type}/{attn}/{'small-windows' if extra else 'default'}"
            try:
                target = tiny(model_type, attn, **extra)
            except Exception as error:  # noqa: BLE001 - transformers cannot build this tiny config / attention
                unbuilt = unbuilt or error
                continue
            try:
                reference = hf_greedy(target, PROMPT, NEW_TOKENS, eos_token_id=2)
            except Exception as error:  # noqa: BLE001 - transformers' own generate fails: nothing to compare with
                results.append((name, f"no reference (transformers' generate fails: {cause(error)})"))
                continue
            vocab = target.get_output_embeddings().weight.shape[0]
            drafts = {"self": target, "llama-draft": tiny_model("llama", vocab=vocab, hidden=32, layers=1, seed=3)}
            for draft_name, draft in drafts.items():
                for budget in BUDGETS:
                    results.append((f"{name}/{draft_name}/b{budget}", outcome(target, draft, budget, reference)))
            results.append((f"{name}/ar", outcome(target, None, 1, reference, tree="ar")))
    return results or [(model_type, f"not built (no tiny model in any attention implementation: {cause(unbuilt)})")]


FULL = os.environ.get("OPTTREE_FULL_SWEEP") == "1"
UNCOMPARED = ("not built", "no reference", "not run")  # outcomes where nothing was compared: each needs its cause


def kind(outcome: str) -> str:
    """An outcome without its details: 'not built (KeyError: ...)' -> 'not built'."""
    return next((prefix for prefix in UNCOMPARED if outcome.startswith(prefix)), outcome)


def expected_kinds(model_type: str) -> set[str]:
    """What every case of an architecture gives, together: the CI subset's pins, else the full sweep's
    (`EXPECTED`), else all identical."""
    return SUBSET.get(model_type) or EXPECTED.get(model_type) or {"identical"}


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) if FULL else sorted(SUBSET))
def test_identical_or_refused(model_type):
    # the full sweep runs each architecture as the counts do: in a child process with memory and time limits
    results = sweep_isolated(model_type) if FULL else sweep_architecture(model_type)
    bad = [(case, result) for case, result in results if result == "WRONG" or result.startswith("UNCLEAR")]
    assert not bad, bad
    assert not unpinned(model_type, results), results


def unpinned(model_type: str, results: list[tuple[str, str]]) -> str | None:
    """Why `results` break the pins (the outcomes occur as listed, no other: a new refusal, one whose reason
    changed, or an architecture no longer built or compared), or None."""
    kinds = {kind(result) for _, result in results}
    if kinds == expected_kinds(model_type):
        return None
    return f"{model_type!r}: {sorted(kinds)}  (pinned: {sorted(expected_kinds(model_type))})"


def test_the_pins_catch_a_family_that_becomes_refused_or_is_no_longer_compared():
    identical = [("x/sdpa/default/self/b1", "identical")]
    assert unpinned("llama", identical) is None and unpinned("qwen3", identical) is None  # unlisted: identical
    assert unpinned("qwen3", identical + [("x/eager", "refused: ALiBi")])  # a new refusal
    assert unpinned("qwen3", [("qwen3", "not built (KeyError: 'x')")])  # no longer built
    assert unpinned("bert", [("x", "refused: bidirectional")]) is None
    assert unpinned("bert", [("x", "refused: hash-bucketed attention (Reformer)")])  # the reason changed


def test_every_pinned_outcome_is_a_known_reason_or_has_its_cause():
    """The pins say why: a refusal by a reason `outcome` recognises, and an architecture that was not
    compared (not built, no reference, not run) with what stopped it in CAUSES."""
    known = {"identical"} | {f"refused: {reason}" for reason in REASONS.values()} | set(UNCOMPARED)
    for model_type, kinds in {**EXPECTED, **SUBSET}.items():
        assert kinds and kinds <= known, (model_type, kinds - known)
        if kinds & set(UNCOMPARED):
            assert len(CAUSES.get(model_type, "")) > 20, f"{model_type}: say what stops the comparison in CAUSES"
    assert not set(SUBSET) & set(EXPECTED), "the CI subset's architectures are pinned in SUBSET only"
    assert set(CAUSES) <= set(EXPECTED), "a cause for an architecture that is not pinned"


def test_mainstream_architectures_are_not_refused():
    for model_type in ("llama", "gpt2", "qwen3"):
        results = [r for case, r in sweep_architecture(model_type) if "default" in case]
        assert results and all(r == "identical" for r in results), (model_type, results)


def sweep_isolated(model_type: str, memory_gb: float = 4, timeout_s: float = 900) -> list[tuple[str, str]]:
    """sweep_architecture in a child process with a memory and a time limit: an architecture whose
    "tiny" config is not small (Byte Latent Transformer: a hash-embedding table) cannot stop the sweep."""
    import resource
    import subprocess

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (int(memory_gb * 2**30),) * 2)

    try:
        child = subprocess.run([sys.executable, __file__, "--one", model_type], capture_output=True, text=True,
                               timeout=timeout_s, preexec_fn=limit, cwd=os.path.dirname(os.path.abspath(__file__)))
    except subprocess.TimeoutExpired:
        return [(model_type, f"not run (over {timeout_s:.0f} s)")]
    if child.returncode != 0:
        return [(model_type, f"not run (over {memory_gb:g} GiB or crashed: exit {child.returncode})")]
    return [tuple(case) for case in json.loads(child.stdout.strip().splitlines()[-1])]


if __name__ == "__main__":  # the full sweep's counts, one child process per architecture
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(sweep_architecture(sys.argv[2])))
        sys.exit(0)
    pin = "--pin" in sys.argv  # rewrite the pins from this run (every architecture)
    names = [name for name in sys.argv[1:] if name != "--pin"]
    if pin and names:
        sys.exit("--pin sweeps every architecture: name none")
    counts, per_arch, changed, pins = Counter(), {}, [], {"expected": {}, "causes": {}}
    for model_type in names or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        results = sweep_isolated(model_type)
        per_arch[model_type] = Counter(r for _, r in results)
        counts.update(r for _, r in results)
        print(model_type, dict(per_arch[model_type]), flush=True)
        kinds, mismatch = {kind(r) for _, r in results}, unpinned(model_type, results)
        if mismatch:
            changed.append(mismatch)
        if model_type not in SUBSET and kinds != {"identical"}:
            pins["expected"][model_type] = sorted(kinds)
            uncompared = sorted(r for _, r in results if kind(r) != r)
            if uncompared:  # 'not built (KeyError: ...)' -> the part in brackets
                pins["causes"][model_type] = uncompared[0].split("(", 1)[1].rstrip(")")
    if pin:
        import transformers

        about = (f"The full sweep's outcomes (python tests/test_architectures.py --pin, transformers "
                 f"{transformers.__version__}): each architecture that is not identical in every case, its outcome "
                 "kinds, and for those not compared, what stopped the comparison. Architectures not listed are "
                 "identical in every case.")
        text = json.dumps({"about": about, **pins}, indent=1)
        PINS.write_text(re.sub(r"\[\n\s+([^\]]*?)\n\s+\]", lambda m: "[" + re.sub(r",\n\s+", ", ", m[1]) + "]", text) + "\n")
        print(f"wrote {PINS}: review the causes before committing it")
    print("TOTAL", dict(counts))
    print("architectures with at least one identical case:",
          sum(1 for c in per_arch.values() if c["identical"]), "of", len(per_arch))
    print("outcomes that differ from the pins (EXPECTED / SUBSET):", *(changed or ["none"]), sep="\n  ")
