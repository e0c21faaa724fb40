"""What a drafter, a candidate source or a depth control declares about itself, as class attributes the
engine reads directly. Inherit `Declared` for these defaults (none of the optional hooks); a user's
object that does not is read once, where it enters (`declared_by`)."""

from __future__ import annotations


class Declared:
    # R > 0: it gets `seed(tokens (R,), logits (R, V))`, the target's logits at the prompt's last R
    # positions, from the prefill (Token Recycling's cold start)
    prompt_rows: int = 0
    # it gets the target's hidden states (`seed_hidden`, `Verification.hidden_states`; a depth control:
    # `limit`'s feature)
    wants_hidden: bool = False
    # it gets the target's cache after the prefill (`share_target_cache`) and drafts on it, one sequence
    # at a time
    reads_target_cache: bool = False
    # in a batch, it drafts in a thread of its own and hands its forwards to the round that batches them
    # with the other rows' (`drafters.together`)
    forwards_together: bool = False
    # it also answers `root_top(committed, k)` and `expand_top(tokens, parent_slots, k)`: each node's k most
    # likely children without the (K, V) rows (a policy that takes top-ranked children asks these instead)
    top_children: bool = False
    # with top_children: every listed row holds its k' children, none padded with -inf, so a policy need not
    # drop padding from its candidates (a shape sync: their number would depend on values)
    full_top_rows: bool = False
    # with top_children: it also answers `host_root_top(root, k)` and `host_expand_top(tokens, depth, k)` in NumPy,
    # the same children read on the host (opttree's own, where their state lives on the CPU: no copy), and names what
    # answers them, `host_lister()` (its `host_top(tokens, depth, k)`): rows whose drafters name one are listed together
    lists_on_host: bool = False
    # it also answers `extend(token)`: `expand` of one node whose parent is the last node it ran this step (the root
    # when none), while every node so far is the next one's ancestor (a chain): run as plain next-token decoding,
    # no tree mask (a chain policy's layers ask this instead)
    extends_chains: bool = False
    # its `observe` may leave what it learns from a row's step for `learned()`, which the engine calls once a step,
    # after every row observed: rows whose drafters share their state (Token Recycling's matrix) learn in one pass
    learns_together: bool = False
    # the networks (`nn.Module`s) it runs: their bf16 linear layers run packed during the steps where that
    # applies (`opttree.packed`); an instance sets its own
    networks: tuple = ()


DECLARED = ("prompt_rows", "wants_hidden", "reads_target_cache", "forwards_together", "top_children", "full_top_rows",
            "lists_on_host", "extends_chains", "learns_together", "networks")


def declared_by(obj: object) -> dict:
    """A user object's declarations (`Declared`'s defaults where it has none): read once, where it enters."""
    return {name: getattr(obj, name, getattr(Declared, name)) for name in DECLARED}


HOOKS = {"prompt_rows": "seed", "wants_hidden": "seed_hidden", "reads_target_cache": "share_target_cache",
         "learns_together": "learned"}


def pass_hooks(wrapper: Declared, inner: object) -> dict:
    """`wrapper` (which stands for `inner`) declares what `inner` declares of HOOKS and its networks, and
    passes those hooks on; returns all of `inner`'s declarations."""
    declared = declared_by(inner)
    wrapper.networks = tuple(declared["networks"])
    for name, hook in HOOKS.items():
        setattr(wrapper, name, declared[name])
        if declared[name]:
            setattr(wrapper, hook, getattr(inner, hook))
    return declared
