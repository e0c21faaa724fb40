"""Several draft sources, one tree (docs/METHODS.md, "Draft sources").

A source is either a `Drafter` (answers distribution queries for tree nodes: the draft model, Token
Recycling) or a `CandidateSource` (proposes a ready trie of continuations with scores: lookup). A
drafter spec names sources joined by "+" (`model+lookup`); `make_sources` turns it into the drafter
the engine drives and the policy that builds each step's tree:

    the first distribution source  --(tree policy)-->  its tree
    every other source             --(propose)------>  a trie, pruned by the draft (RASD)
    merge (identical paths become one node)  ->  the `budget` best nodes by score  ->  verify

Scores are log estimates of acceptance, so sources compare: a draft model's path log-probability,
Token Recycling's and lookup's online hit rates. The candidates are deterministic, so verification
(`verify.accept_path`) is exact at any temperature. At temperature > 0 the first source's children are
sampled (`children="sampled"`, the default of opt and eagle2) and the others' tries join them as
deterministic candidates (`MergedPolicy`); dyspec and sequoia sample from one source only.
"""

from __future__ import annotations

import math
import weakref
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch

from ...parts import shipped_part
from ...settings.config import DEFAULT_MAX_DEPTH, SpecConfig
from ...settings.declared import pass_hooks
from ...settings.drafter_spec import KINDS, DrafterSpec, declare_source
from ...settings.names import BUILTIN_SOURCE_KINDS, TRAINED_SOURCES, SourceKind
from ..tree import DraftTree, merge_best, merge_sampled, node_paths, top_nodes
from ..verify import Verification
from . import Declared, Drafter
from .datastore import open_datastore
from .held import HeldDrafter
from .lookup import DatastoreSource, LookupSource
from .recycling import RecyclingDrafter

PRUNE_RANK = 16  # RASD: a retrieved branch survives if its first token is among the draft's 16 best
# Under sampled children, a candidate source's node enters the tree when its estimated acceptance reaches this
LOG_PROPOSED_MIN = math.log(0.25)


class CandidateSource(Protocol):
    def start(self, input_ids: torch.Tensor) -> None:
        """A new generation begins with the prompt (T,)."""

    def propose(self, committed: torch.Tensor, max_nodes: int, max_depth: int) -> DraftTree:
        """A trie of at most `max_nodes` continuations of `committed` (T,), at most `max_depth` deep,
        scored with log estimates of acceptance; `draft_slots` all -1; no two siblings share a token."""

    def observe(self, result: Verification) -> None:
        """The step's verification (see `Drafter.observe`)."""


class SourceContext:
    """What a source factory may use: the target, the draft as a Drafter (None without one), the config; `held`:
    the request's grammar (`opttree.grammar.Constraint`) its first distribution source is held to, if any."""

    def __init__(self, target, draft: Drafter | None, config, vocab: int, device: torch.device, held=None):
        self.target, self.draft, self.config, self.vocab, self.device = target, draft, config, vocab, device
        self.held = held


SourceFactory = Callable[[SourceContext], "Drafter | CandidateSource"]
_FACTORIES: dict[str, SourceFactory] = {}  # name -> what makes its drafter for a generation


def register_source(name: str, kind: SourceKind) -> Callable[[SourceFactory], SourceFactory]:
    """Make a draft source selectable by name (`drafter="a+b"`, `--drafter`, `opt:a+b`), with what it does
    (`SourceKind`: a Drafter (root/expand/observe) if `kind.distribution`, else a CandidateSource
    (start/propose/observe); whether a layer runs a network; whether its children are sampled)."""

    def add(factory: SourceFactory) -> SourceFactory:
        _FACTORIES[name] = factory
        declare_source(name, kind)
        return factory

    return add


def available_sources() -> list[str]:
    return sorted(_FACTORIES)


def _model(context: SourceContext) -> Drafter:
    if context.draft is None:
        raise ValueError("drafter 'model' needs a draft model (draft=... / --draft); without one use a "
                         "train-free drafter: recycling, lookup or recycling+lookup")
    return context.draft


# Sampling children from a network's distribution: at temperature 1 on HumanEval, 0.68x -> 0.98x over
# plain decoding (docs/BENCHMARKS.md); why recycling keeps top-ranked children: `opttree.settings.names`.
register_source("model", BUILTIN_SOURCE_KINDS["model"])(_model)
register_source("recycling", BUILTIN_SOURCE_KINDS["recycling"])(lambda c: RecyclingDrafter(c.target, c.vocab, c.device))
register_source("lookup", BUILTIN_SOURCE_KINDS["lookup"])(lambda c: LookupSource(c.target))


def _datastore(context: SourceContext) -> DatastoreSource:
    if context.config.datastore is None:
        raise ValueError("drafter 'datastore' needs a datastore folder (datastore=DIR / --datastore DIR), built "
                         "with `opttree datastore build FILES --out DIR`")
    store = open_datastore(context.config.datastore)
    store.check_vocab(context.vocab)
    return DatastoreSource(context.target, store)


register_source("datastore", BUILTIN_SOURCE_KINDS["datastore"])(_datastore)


# target -> {(name, folder, its files' newest mtime, device, dtype): the loaded part}
_LOADED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _trained(name: str, what: str, parts: Callable[[], tuple[Callable, type]]) -> None:
    """Register a source that reads a part trained for the target (TRAINED_SOURCES: its folder's option;
    without one, the part shipped for the shipped target, `models/<option>`, if this is that target).
    A part is loaded once per target and folder (until its files change); each generation gets its own
    drafter over it (the drafter holds the per-generation state)."""
    option = TRAINED_SOURCES[name]

    def factory(context: SourceContext) -> Drafter:
        folder = getattr(context.config, option) or shipped_part(option, context.target)
        if folder is None:
            raise ValueError(f"drafter {name!r} needs {what} trained for this target (none ships for it): "
                             f"{option}=DIR / --{name} DIR (train one with `opttree train {name} --target PATH`)")
        path, target = Path(folder).resolve(), context.target
        changed = max((f.stat().st_mtime_ns for f in path.glob("*")), default=0) if path.is_dir() else 0
        key = (name, str(path), changed, str(context.device), target.get_output_embeddings().weight.dtype)
        load, drafter = parts()
        loaded = _LOADED.setdefault(context.target, {})
        if key not in loaded:
            loaded[key] = load(folder, context.target)
        return drafter(loaded[key], context.target, context.vocab, sampling=context.config.temperature > 0)

    register_source(name, BUILTIN_SOURCE_KINDS[name])(factory)


def _head():  # (loader, drafter class), imported when first used
    from .head import HeadDrafter, load_head

    return load_head, HeadDrafter


def _early_exit():
    from .early_exit import EarlyExitDrafter, load_early_exit

    return load_early_exit, EarlyExitDrafter


_trained("head", "a feature head", _head)
_trained("early-exit", "an exit layer", _early_exit)


class TrieDrafter(Declared):
    """A candidate source as the step's only distribution source: a node's children get
    log(child score) - log(node score) for the trie's continuations, -inf for every other token."""

    top_children = True  # a node has few children: `root_top` / `expand_top` list them, no (K, V) rows

    def __init__(self, source: CandidateSource, vocab: int, max_nodes: int, max_depth: int):
        self.source, self.vocab, self.max_nodes, self.max_depth = source, vocab, max_nodes, max_depth
        self.children: dict[tuple[int, ...], list[tuple[int, float]]] = {}  # best first
        self.slot_paths: list[tuple[int, ...]] = []

    def start(self, input_ids: torch.Tensor) -> None:
        self.source.start(input_ids)

    def root(self, committed: torch.Tensor) -> torch.Tensor:
        self._open(committed, self.max_nodes)
        return self._rows([()])[0]

    def expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
        return self._rows(self._run(tokens, parent_slots))

    def root_top(self, committed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._open(committed, min(k, self.max_nodes))  # a tree of k nodes (OPT-Tree's) holds no more of the trie
        tokens, logq = self._top([()], k)
        return tokens[0], logq[0]

    def expand_top(self, tokens: torch.Tensor, parent_slots: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._top(self._run(tokens, parent_slots), k)

    def _open(self, committed: torch.Tensor, nodes: int) -> None:
        """A new tree: the source's trie of `nodes` nodes after `committed`, as each path's children."""
        trie = self.source.propose(committed, nodes, self.max_depth)
        scores = dict(zip(node_paths(trie), trie.scores.tolist()))
        self.children = {}
        for path, score in scores.items():
            self.children.setdefault(path[:-1], []).append((path[-1], score - scores.get(path[:-1], 0.0)))
        for listed in self.children.values():
            listed.sort(key=lambda child: -child[1])
        self.slot_paths, self.device = [], committed.device

    def _run(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> list[tuple[int, ...]]:
        """Nodes (K,) take the next slots: their token paths."""
        paths = [(self.slot_paths[p] if p >= 0 else ()) + (t,) for t, p in zip(tokens.tolist(), parent_slots.tolist())]
        self.slot_paths += paths
        return paths

    def _rows(self, paths: list[tuple[int, ...]]) -> torch.Tensor:
        rows = torch.full((len(paths), self.vocab), float("-inf"))  # (R, V)
        for i, path in enumerate(paths):
            for token, log_p in self.children.get(path, []):
                rows[i, token] = log_p
        return rows.to(self.device)

    def _top(self, paths: list[tuple[int, ...]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, k') tokens and log-probabilities of each path's k best children, k' = the most any has
        (at least 1), short rows padded with -inf."""
        listed = [self.children.get(path, [])[:k] for path in paths]
        width = max(1, *(len(children) for children in listed))
        tokens = [[t for t, _ in children] + [0] * (width - len(children)) for children in listed]
        logq = [[s for _, s in children] + [float("-inf")] * (width - len(children)) for children in listed]
        return (torch.tensor(tokens, dtype=torch.long, device=self.device),
                torch.tensor(logq, dtype=torch.float32, device=self.device))

    def observe(self, result: Verification) -> None:
        self.source.observe(result)


class DrafterCandidates(Declared):
    """A distribution source as a candidate source: its own OPT-Tree (delta 0) under the same budget."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.start, self.observe = drafter.start, drafter.observe
        pass_hooks(self, drafter)

    def propose(self, committed: torch.Tensor, max_nodes: int, max_depth: int) -> DraftTree:
        from ..policies.opt import OptTree  # policies import drafters: imported when first used

        policy = OptTree(SpecConfig(budget=max_nodes, delta=0.0, max_depth=max_depth))
        tree = policy.build(self.drafter, committed, max_depth)
        return DraftTree(tree.tokens, tree.parents, tree.depths, tree.scores, torch.full_like(tree.tokens, -1))


class Sources(Declared):
    """The step's drafter when sources are combined: the first answers the policy's queries (its root
    distribution is kept for RASD's pruning), every source hears `start`, `seed` and `observe`."""

    def __init__(self, first: Drafter, candidates: list[CandidateSource]):
        self.first, self.candidates = first, candidates
        self.prompt_rows = max(s.prompt_rows for s in [first, *candidates])
        self.wants_hidden = any(s.wants_hidden for s in [first, *candidates])
        self.reads_target_cache = any(s.reads_target_cache for s in [first, *candidates])
        self.learns_together = any(s.learns_together for s in [first, *candidates])
        self.forwards_together = first.forwards_together  # candidates batch no forwards of their own
        self.top_children, self.full_top_rows = first.top_children, first.full_top_rows
        self.lists_on_host = first.lists_on_host
        self.extends_chains = first.extends_chains
        self.networks = tuple(net for source in [first, *candidates] for net in source.networks)
        self.root_logq: torch.Tensor | None = None

    def start(self, input_ids: torch.Tensor) -> None:
        for source in [self.first, *self.candidates]:
            source.start(input_ids)

    def seed(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        for source in [self.first, *self.candidates]:
            if source.prompt_rows:
                source.seed(tokens[-source.prompt_rows :], logits[-source.prompt_rows :])

    def seed_hidden(self, hidden_states: tuple[torch.Tensor, ...]) -> None:
        for source in [self.first, *self.candidates]:
            if source.wants_hidden:
                source.seed_hidden(hidden_states)

    def share_target_cache(self, cache) -> None:
        for source in [self.first, *self.candidates]:
            if source.reads_target_cache:
                source.share_target_cache(cache)

    def root(self, committed: torch.Tensor) -> torch.Tensor:
        self.root_logq = self.first.root(committed)  # (V,)
        return self.root_logq

    def expand(self, tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
        return self.first.expand(tokens, parent_slots)

    def extend(self, token: torch.Tensor) -> torch.Tensor:
        return self.first.extend(token)

    def root_top(self, committed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.root_logq = None  # no (V,) row: RASD's pruning reads a draft model's, which lists no top children
        return self.first.root_top(committed, k)

    def expand_top(self, tokens: torch.Tensor, parent_slots: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.first.expand_top(tokens, parent_slots, k)

    def host_root_top(self, root: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        self.root_logq = None  # as `root_top`
        return self.first.host_root_top(root, k)

    def host_expand_top(self, tokens: np.ndarray, depth: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.first.host_expand_top(tokens, depth, k)

    def host_lister(self):
        return self.first.host_lister()

    def observe(self, result: Verification) -> None:
        for source in [self.first, *self.candidates]:
            source.observe(result)

    def learned(self) -> None:
        for source in [self.first, *self.candidates]:
            if source.learns_together:
                source.learned()


class MergedPolicy:
    """A tree policy over the first source, the other sources' tries merged in, the best `budget` kept.

    When the policy samples its children (temperature > 0), the tries' candidates are chosen first, by
    their own scores (estimated acceptance at least exp(LOG_PROPOSED_MIN), at most the budget), and the
    sampled tree keeps its best-keyed nodes in the budget left: neither choice looks at the tokens the
    draft drew, which keeps the mixed tree's verification exact (`verify.accept_rejection_sampling`)."""

    needs_drafter = True

    def __init__(self, policy, budget: int, max_depth: int, prune: bool):
        self.policy, self.budget, self.max_depth, self.prune = policy, budget, max_depth, prune
        self.sampled = samples_children(policy)

    def build(self, sources: Sources, committed: torch.Tensor, depth_limit: int) -> DraftTree:
        return self.merged(sources, committed, depth_limit, self.policy.build(sources, committed, depth_limit))

    def merged(self, sources: Sources, committed: torch.Tensor, depth_limit: int, tree: DraftTree) -> DraftTree:
        """The first source's `tree` (its policy's) with the other sources' tries merged in."""
        proposals = []
        for source in sources.candidates:
            proposal = source.propose(committed, self.budget, min(self.max_depth, depth_limit))
            if self.prune and len(proposal) and sources.root_logq is not None:
                proposal = prune_first_tokens(proposal, sources.root_logq, PRUNE_RANK)
            proposals.append(proposal.to(tree.tokens.device))
        if not proposals:
            return tree
        if not self.sampled:
            return merge_best([tree, *proposals], self.budget)
        fixed = merge_best(proposals, self.budget, floor=LOG_PROPOSED_MIN)
        return merge_sampled(top_nodes(tree, self.budget - len(fixed), by=tree.keys), fixed)


def samples_children(policy) -> bool:
    """Whether this policy draws its children from the draft in this generation (its `ChildPicker`)."""
    picker = getattr(policy, "picker", None)  # static, chain, ar and user policies may have none
    return bool(picker is not None and picker.sampled)


def prune_first_tokens(trie: DraftTree, root_logq: torch.Tensor, rank: int) -> DraftTree:
    """RASD's pruning: the branches whose first token is not among the draft's `rank` best scored -inf (the
    same nodes, so nothing is read back: `merge_best` drops them, or keeps them last where it fills a size)."""
    best = root_logq.topk(min(rank, root_logq.shape[0])).indices.to(trie.tokens.device)
    first_ok = torch.isin(trie.tokens, best) & (trie.parents < 0)  # (N,) the first nodes that stay
    keep = (trie.ancestors & first_ok[None, :]).any(dim=1)  # (N,) a node stays if its branch's first node does
    return DraftTree(trie.tokens, trie.parents, trie.depths, trie.scores.masked_fill(~keep, float("-inf")),
                     trie.draft_slots)


def default_max_depth(spec: DrafterSpec, budget: int) -> int:
    """max_depth when the caller gives none: DEFAULT_MAX_DEPTH (8) when a network drafts (a layer costs a
    forward of it); otherwise the budget, at least 8: recycled and retrieved layers cost no forward pass,
    and a retrieved copy is as long as the budget lets it be (measured: docs/BENCHMARKS.md, "Depth:
    train-free layers are free")."""
    return DEFAULT_MAX_DEPTH if spec.runs_network else max(DEFAULT_MAX_DEPTH, budget)


def default_children(children: str, spec: DrafterSpec, policy) -> str:
    """`children` with "auto" resolved where the drafter spec decides it: sampled children are drawn from
    the first source's distribution where it is one to sample from (`SourceKind.sampled`: the draft
    model, the head, early exit), and other sources' candidates join them only under a policy whose
    sampled trees keep their keys (`TreePolicy.sampled_keys`). Elsewhere "auto" takes the top-ranked
    ("top"); where children can be sampled it stays the policy's own choice."""
    if children != "auto" or not policy.needs_drafter:
        return children
    mixable = len(spec.names) == 1 or policy.sampled_keys
    return "auto" if spec.first.sampled and mixable else "top"


def make_sources(spec: DrafterSpec, policy, config, context: SourceContext):
    """(drafter, policy) for the engine: the drafter spec's sources, combined as described above."""
    if context.draft is not None and not spec.uses_draft_model:
        raise ValueError(f"a draft model was given but drafter {spec!r} does not use it: add 'model' "
                         f"(e.g. 'model+{spec}') or leave the draft out")
    if config.datastore is not None and "datastore" not in spec:
        raise ValueError(f"a datastore was given but drafter {spec!r} does not use it: add 'datastore' "
                         f"(e.g. '{spec}+datastore')")
    if config.draft_temperature != 1 and not spec.uses_draft_model:
        raise ValueError(f"draft_temperature applies to a draft model; drafter {spec!r} has none")
    made = [(_FACTORIES[n](context), KINDS[n].distribution) for n in spec.names]
    if context.held is not None and made[0][1]:  # the first distribution source drafts what the grammar takes
        made[0] = (HeldDrafter(made[0][0], context.held), True)
    if len(made) == 1 and spec.first.draft_model:  # the draft model alone: the policy drives it directly
        return made[0][0], policy
    first, distribution = made[0]
    if samples_children(policy) and (not distribution or (len(made) > 1 and not policy.sampled_keys)):
        listed = ", ".join(sorted(n for n, kind in KINDS.items() if kind.distribution))
        takes = f"a distribution source first ({listed})" if policy.sampled_keys else \
            f"one distribution source ({listed})"
        raise ValueError(f"tree={config.tree!r} samples its children at temperature > 0 and its verification "
                         f"needs exactly the draft distribution it sampled from: it takes {takes}, not {spec!r} "
                         "(or take the top-ranked children: children='top')")
    if not distribution:  # candidate sources only: the first one answers the policy's queries
        first = TrieDrafter(first, context.vocab, config.budget, config.max_depth)
    candidates = [DrafterCandidates(s) if d else s for s, d in made[1:]]
    sources = Sources(first, candidates)
    return sources, MergedPolicy(policy, config.budget, config.max_depth, prune=spec.first.draft_model)
