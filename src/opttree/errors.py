"""Errors of opttree's own that the CLI reports as a one-line message (importing no torch)."""


class RanksDiverged(RuntimeError):
    """The ranks of a tensor-parallel generation no longer hold the same tokens (`opttree.parallel`)."""
