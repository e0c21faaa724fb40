"""The built-in tree policy and draft source names, importable without torch (for the CLI's `--help`).

The registries (`opttree.policies.available()`, `opttree.drafters.sources.available_sources()`) are the
truth; tests/test_imports.py checks that these lists match them."""

BUILTIN_POLICIES = ("ar", "chain", "dyspec", "eagle2", "opt", "recycling-template", "sequoia", "static", "static-k2",
                    "static-k3")
BUILTIN_SOURCES = ("datastore", "early-exit", "head", "lookup", "model", "recycling")
# The sources that load a trained part: source name -> the option (SpecConfig field, --flag) naming its folder.
TRAINED_SOURCES = {"head": "head", "early-exit": "early_exit"}
TRAINED_HELP = {"head": "a folder from `opttree train head`: the EAGLE-style feature head (default: the shipped "
                        "head, for the shipped target)",
                "early-exit": "a folder from `opttree train early-exit`: the target's first layers and a trained exit layer"}
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
QUANTIZATIONS = ("int4", "int8")  # opttree.quantize.SCHEMES (tests/test_imports.py checks)
