"""Verification as a batch of root-to-leaf chains, for the targets a tree under one mask cannot drive:
models with recurrent or convolution state (LFM2, Granite 4 hybrids, Qwen3-Next, Jamba, Mamba; RWKV and
MiniMax, whose states live outside transformers' cache layers: `opttree.step.own_state`), and KV
models whose attention reads a key's *index* in the cache where a tree needs its position (ALiBi: BLOOM,
MPT, Falcon with `alibi=True`; GPT-Neo's local layers; positions counted from the cache length: BART's
decoder family). In a chain, every key's index is its position.

A state layer keeps one summary of the whole past, not a key per position, so a tree cannot share a
prefix through an attention mask and the state cannot be cut back to the accepted branch. Instead:
1. the cache (its KV layers and its states) is saved, as references: every update makes new tensors
   or writes into the copies `reorder_cache` makes;
2. it is replicated to L rows, one per leaf, and one forward runs the L chains [root, path to the leaf]
   (right-padded to the deepest leaf: padding after a chain changes none of its outputs); a node's
   logits are read from any chain through it;
3. after acceptance the saved cache is put back and the root and the accepted tokens are run through
   it (one forward of A + 1 tokens), which leaves it holding the committed tokens but the new root.
   A cache of KV layers only needs no replay: the row of a chain through the last accepted node is
   kept and cut after it.
Exact where the model's forward over several new tokens continues its cached state as token-by-token
decoding does; `probe_chains` checks that for every model first (transformers' Mamba-1 mixers restart the
scan from zero on a multi-token forward: `opttree.step.scan` continues it from the cached state). The cost against a tree
forward: the target's forward runs L x (D + 1) tokens instead of N + 1 (plus, with state layers, a
replay of A + 1 tokens).
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch
from transformers import Cache, DynamicCache, PreTrainedModel

from .attention import STATE_LAYER_TYPES
from .cache import cache_argument, truncate
from .lean import lean_forward
from .own_state import OwnState, keeps_own_state, layer_attributes, own_state, put_back
from .scan import continued_scans
from .tree import DraftTree, leaf_paths


def has_state(model: PreTrainedModel) -> bool:
    """Whether the model declares layers that hold a recurrent or convolution state, or keeps a state of
    its own outside transformers' cache layers (`opttree.step.own_state`: RWKV, MiniMax)."""
    types = getattr(model.config.get_text_config(), "layer_types", None) or []
    return any(kind in STATE_LAYER_TYPES for kind in types) or keeps_own_state(model)


ALIBI_TYPES = ("bloom", "mpt")
CACHE_POSITION_TYPES = ("bart", "mbart", "marian", "pegasus", "blenderbot", "blenderbot-small", "plbart", "mvp",
                        "trocr", "bigbird_pegasus", "roformer")


def index_attention(config) -> str | None:
    """How a text config's attention reads key indices in the cache instead of positions (None: it does
    not): a tree's node sits at index prefix + i but at position prefix + depth - 1."""
    attn_config = getattr(config, "attn_config", None)
    mpt_alibi = attn_config.get("alibi") if isinstance(attn_config, dict) else getattr(attn_config, "alibi", None)
    if config.model_type in ALIBI_TYPES or getattr(config, "alibi", False) or mpt_alibi:
        return "it uses ALiBi, whose bias comes from the key's index in the cache, not from position_ids"
    if config.model_type in CACHE_POSITION_TYPES:
        return "its positions are derived from the cache length, not from position_ids"
    if "local" in (getattr(config, "attention_layers", None) or []):
        return (f"its local-attention layers slice a causal buffer by key index (window_size="
                f"{getattr(config, 'window_size', None)}, counted in cache rows)")
    return None


def verified_as_chains(model: PreTrainedModel) -> bool:
    """Whether a model runs as chains rather than under a tree mask: a target verified as a batch of chains
    (`ChainVerifier`), a draft drafting each node's path as a chain (`drafters.model.ChainDrafter`)."""
    return has_state(model) or index_attention(model.config.get_text_config()) is not None


def state_cache(model: PreTrainedModel) -> Cache | OwnState:
    """transformers' cache laid out for the model's layer types (state layers and KV layers), or the state
    the model keeps outside its layers (`opttree.step.own_state`)."""
    state = own_state(model)
    return state if state is not None else DynamicCache(config=model.config)


class ChainVerifier:
    """One step's verification of a tree on a state model: `logits`, then `commit` after acceptance (the
    calls of `opttree.step.verify.TreeVerifier`)."""

    rows = 1  # one sequence: its cache's batch axis holds the chains

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.replays = has_state(model)  # a state cannot be cut back: restore and replay (else keep a chain's row)
        self.saved: list[dict] | None = None
        self.chain_of: torch.Tensor | None = None  # (N,) a chain through each node of the step's tree

    def logits(self, cache: Cache, roots: list[torch.Tensor], trees: list[DraftTree], prefix_lens: list[int],
               riders: tuple = ()) -> list[torch.Tensor]:
        """[(N + 1, V)] the target's logits at [root] + nodes of the one row; the cache is replicated and
        extended (and restored by `commit`). One sequence: no prompt rides it (`riders` empty)."""
        assert not riders, "a target verified as chains runs one sequence: no prompt rides its forward"
        (root,), (tree,), (prefix_len,) = roots, trees, prefix_lens
        return [self._logits(cache, root, tree, prefix_len)]

    def _logits(self, cache: Cache, root: torch.Tensor, tree: DraftTree, prefix_len: int) -> torch.Tensor:
        device = root.device
        if len(tree) == 0:  # the root alone: it is the step's one committed token, nothing to restore
            self.saved = None
            return self._run(cache, root.view(1, 1), prefix_len)[0]  # (1, V)
        self.saved = save_layers(cache) if self.replays else []
        paths = leaf_paths(tree.parents, tree.depths)  # (L, D) node indices, -1 past a leaf
        chains = torch.cat([root.view(1, 1).expand(paths.shape[0], 1),
                            torch.where(paths >= 0, tree.tokens[paths.clamp(min=0)], root)], dim=1)  # (L, D+1)
        cache.reorder_cache(torch.zeros(paths.shape[0], dtype=torch.long, device=device))  # (L,) copies of row 0
        out = self._run(cache, chains, prefix_len)  # (L, D+1, V)
        # a chain through each node: one of the leaves whose path holds it (all give the node the same logits)
        leaf = torch.arange(paths.shape[0], device=device)[:, None].expand_as(paths)
        chain_of = torch.zeros(len(tree), dtype=torch.long, device=device)
        chain_of[paths[paths >= 0]] = leaf[paths >= 0]
        self.chain_of = chain_of
        nodes = out[chain_of, tree.depths]  # (N, V): node i's logits sit at column depth_i of its chain
        return torch.cat([out[0, :1], nodes])  # (N+1, V)

    def commit(self, cache: Cache, roots: list[torch.Tensor], trees: list[DraftTree], accepted: list[torch.Tensor],
               prefix_lens: list[int], firsts: list[bool] | None = None) -> None:
        """Back to the saved cache, then the root and the accepted nodes' tokens (A,) through it; a KV cache:
        the row of a chain through the last accepted node, cut after it."""
        (root,), (tree,), (accepted,), (prefix_len,) = roots, trees, accepted, prefix_lens
        if self.saved is None:  # an empty tree: the cache already holds the root
            return
        if not self.replays:  # that chain's row holds [root] + the accepted path at columns 0..A
            chain = self.chain_of[accepted[-1:]] if accepted.shape[0] else self.chain_of[:1]  # (1,)
            cache.reorder_cache(chain)
            truncate(cache, prefix_len + 1 + accepted.shape[0])
            self.saved = None
            return
        restore_layers(cache, self.saved)
        self.saved = None
        self._run(cache, torch.cat([root.view(1), tree.tokens[accepted]])[None], prefix_len)

    def _run(self, cache: Cache, tokens: torch.Tensor, prefix_len: int) -> torch.Tensor:
        return forward_chains(self.model, cache, tokens, prefix_len)


def forward_chains(model: PreTrainedModel, cache: Cache, tokens: torch.Tensor, prefix_len: int, **options) -> torch.Tensor:
    """(B, Q) tokens after the cache's `prefix_len` (one chain per cache row) -> logits (B, Q, V)."""
    positions = torch.arange(prefix_len, prefix_len + tokens.shape[1], device=tokens.device).expand_as(tokens)
    where = {"position_ids": positions} if _takes_positions(type(model)) else {}  # Mamba has none
    run = lean_forward(model, None) or model  # the model's own forward, or the same without its wrapping
    with continued_scans(model):  # Mamba-1 mixers: the scan from the cached state, not from zero
        return run(input_ids=tokens, **where, **{cache_argument(model): cache}, use_cache=True, **options).logits


@lru_cache(maxsize=None)
def _takes_positions(model_class: type) -> bool:
    return "position_ids" in inspect.signature(model_class.forward).parameters


def save_layers(cache: Cache | OwnState):
    """Each cache layer's attributes (`own_state.layer_attributes`), or a state's of its own."""
    return cache.save() if isinstance(cache, OwnState) else [layer_attributes(layer) for layer in cache.layers]


def restore_layers(cache: Cache | OwnState, saved) -> None:
    if isinstance(cache, OwnState):
        cache.restore(saved)
        return
    for layer, attributes in zip(cache.layers, saved):
        put_back(layer, attributes)


def probe_chains(model: PreTrainedModel) -> str | None:
    """The reason chain verification would not be exact on `model` (None: exact): a cached prefill, then
    a batch of two chains, then a restore and a replay, each against a forward of the whole sequence."""
    device = model.device
    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, max(vocab, 4), (12,), generator=g).clamp(max=vocab - 1).to(device)
    with torch.inference_mode():
        full = model(input_ids=tokens[None], use_cache=False).logits[0]  # (12, V)
        cache = state_cache(model)
        verifier = ChainVerifier(model)
        verifier._run(cache, tokens[None, :6], 0)  # the prefill
        tree = DraftTree(tokens[7:10], torch.tensor([-1, 0, 1], device=device), torch.tensor([1, 2, 3], device=device),
                         torch.zeros(3, device=device), torch.full((3,), -1, device=device))
        (logits,) = verifier.logits(cache, [tokens[6]], [tree], [6])  # (4, V): one chain, positions 6..9
        if not _close(logits, full[6:10]):
            return "a forward of several new tokens from a cached state differs from a forward of the whole sequence"
        verifier.commit(cache, [tokens[6]], [tree], [torch.tensor([0, 1], device=device)], [6])  # root + 2: the cache holds 0..8
        (step,) = ChainVerifier(model).logits(cache, [tokens[9]], [DraftTree.empty(device)], [9])  # (1, V) at position 9
        if not _close(step, full[9:10]):
            return "after restoring the saved state and replaying the accepted tokens, the next step differs"
    return None


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = 1.0 + float(b.float().abs().max())
    return float((a.float() - b.float()).abs().max()) <= max(1e-4, 16 * torch.finfo(a.dtype).eps) * scale
