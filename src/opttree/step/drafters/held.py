"""A drafter held to the request's grammar (`opttree.grammar`): its distributions masked as the target's are.

The target's scores at a node the grammar refuses are -inf, so a draft that proposes such a token wastes the node.
Masked the same way (and renormalised), the draft spends its tree on tokens the grammar takes, and where the grammar
forces one token (a JSON key, a bracket) the draft's probability of it is 1, so OPT-Tree's p-hat carries the tree
through the forced run and on into what follows. Verification is exact for any draft distribution: this changes
which tokens are tried, never which are emitted.
"""

from __future__ import annotations

import torch

from ...settings.declared import Declared, pass_hooks
from ..verify import Verification


class HeldDrafter(Declared):
    """`inner`'s root and expand rows, each masked by `constraint` at that node's context (the committed tokens, then
    the path from the root to the node) and renormalised; a row the mask would leave empty (the draft gives no
    probability to any token the grammar takes: Token Recycling's rows list a few tokens) gives the tokens the grammar
    takes equal chances (a forced one: 1). It lists no top children and drafts one row at a time: the masks are the
    grammar's, computed on the host."""

    def __init__(self, inner, constraint):  # an `opttree.grammar.Constraint`: its `allowed` and `prompt_len`
        self.inner, self.constraint = inner, constraint
        pass_hooks(self, inner)
        self.answer: list[int] = []  # the committed tokens after the prompt
        self.paths: list[list[int]] = []  # this step's slots: each node's tokens after the root

    def start(self, input_ids: torch.Tensor) -> None:
        self.inner.start(input_ids)

    def root(self, committed: torch.Tensor) -> torch.Tensor:
        self.answer, self.paths = committed.tolist()[self.constraint.prompt_len:], []
        return self._held(self.inner.root(committed)[None], [[]])[0]

    def expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
        paths = [(self.paths[p] if p >= 0 else []) + [t] for t, p in zip(tokens.tolist(), parent_slots.tolist())]
        self.paths += paths
        return self._held(self.inner.expand(tokens, parent_slots), paths)

    def observe(self, result: Verification) -> None:
        self.inner.observe(result)

    def _held(self, logq: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """(K, V) log-probabilities, masked at each row's path and renormalised."""
        allowed = self.constraint.allowed([self.answer + path for path in paths], logq.shape[-1]).to(logq.device)
        held = logq.masked_fill(~allowed, float("-inf"))  # (K, V)
        empty = torch.isinf(held.amax(dim=-1))  # (K,) no allowed token the draft gives any chance
        if bool(empty.any()):  # (the masks were read on the host: one more read costs nothing here)
            held[empty] = allowed[empty].to(held.dtype).log()  # there: the allowed tokens alike
        return torch.log_softmax(held, dim=-1)
