"""Tree policies: who decides the shape of the draft tree. Selected by name from a registry
(`opttree.step.policies.registry`); importing this package registers the built-in ones."""

from __future__ import annotations

from . import ar, chain, dyspec, eagle2, opt, sequoia, static  # noqa: F401  (register the built-in policies)
from .registry import TreePolicy, available, make_policy, register_policy
from .shapes import select_best

__all__ = ["TreePolicy", "register_policy", "available", "make_policy", "select_best"]
