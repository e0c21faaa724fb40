"""opttree: lossless speculative decoding over adaptive draft trees (OPT-Tree) for Hugging Face causal LMs.

The public names load their modules on first use (PEP 562), so that `import opttree.cli` can set
thread policies before torch is imported.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "SpecConfig": "settings.config",
    "demo_models": "demo",
    "compile_model": ("device", "compile_model"),
    "Generation": "engine",
    "GenerationOutput": "engine",
    "generate": "speculator",
    "stream": "speculator",
    "Speculator": "speculator",
    "Request": "speculator",
    "available_policies": ("step.policies", "available"),
    "register_policy": "step.policies",
    "GenerationStats": "stats",
    "TextStream": "text",
    "DraftTree": "step.tree",
    "profile_options": ("profiles", "calibrated_options"),
    "custom_generate": ("hf_generate", "custom_generate"),
    "shipped_path": "shipped",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'opttree' has no attribute {name!r}")
    module, attr = _EXPORTS[name] if isinstance(_EXPORTS[name], tuple) else (_EXPORTS[name], name)
    value = getattr(importlib.import_module(f".{module}", __name__), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
