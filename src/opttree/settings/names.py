"""The built-in tree policy and draft source names, importable without torch (for the CLI's `--help`),
and what each draft source is declared to do (`SourceKind`).

The registries (`opttree.step.policies.available()`, `opttree.step.drafters.sources.available_sources()`) are the
truth; tests/test_imports.py checks that these lists match them."""

from dataclasses import dataclass

BUILTIN_POLICIES = ("ar", "chain", "dyspec", "eagle2", "opt", "recycling-template", "sequoia", "static", "static-k2",
                    "static-k3")


@dataclass(frozen=True)
class SourceKind:
    """What a draft source does, declared where it is registered (`opttree.step.drafters.sources.register_source`)
    and read by `opttree.settings.drafter_spec.DrafterSpec`, never guessed from its name."""

    distribution: bool  # a Drafter (root / expand / observe: a distribution per node), else a candidate source
    network: bool = False  # a draft layer costs a forward of a network (the draft model, the head, early exit)
    sampled: bool = False  # as the first source, its children are drawn from its distribution at temperature > 0
    draft_model: bool = False  # drafts with the draft model the caller gives (draft=..., --draft)
    own_cache: bool = False  # drafts on the target's own growing cache (early exit): no preallocated static cache


# A network's distribution is worth sampling children from; Token Recycling's rows are last-seen target
# top-k lists kept across generations, so its sampled trees would make a seeded generation depend on the
# ones before it: it keeps top-ranked children (`opttree.step.drafters.sources.default_children`).
BUILTIN_SOURCE_KINDS = {
    "datastore": SourceKind(distribution=False),
    "early-exit": SourceKind(distribution=True, network=True, sampled=True, own_cache=True),
    "head": SourceKind(distribution=True, network=True, sampled=True),
    "lookup": SourceKind(distribution=False),
    "model": SourceKind(distribution=True, network=True, sampled=True, draft_model=True),
    "recycling": SourceKind(distribution=True),
}
BUILTIN_SOURCES = tuple(BUILTIN_SOURCE_KINDS)
# The sources that load a trained part: source name -> the option (SpecConfig field, --flag) naming its folder.
TRAINED_SOURCES = {"head": "head", "early-exit": "early_exit"}
TRAINED_HELP = {"head": "a folder from `opttree train head`: the EAGLE-style feature head (default: the shipped "
                        "head, for the shipped target)",
                "early-exit": "a folder from `opttree train early-exit`: the target's first layers and a trained exit layer"}
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
QUANTIZATIONS = ("int4", "int8")  # opttree.quantize.SCHEMES (tests/test_imports.py checks)
