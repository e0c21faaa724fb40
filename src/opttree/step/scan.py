"""Mamba-1's selective scan continued from the cached state, so that Mamba, Falcon-Mamba, Jamba and Zamba run
as chains.

transformers' Mamba-1 mixers (`MambaMixer`, `FalconMambaMixer`, `JambaMambaMixer`, `ZambaMambaMixer`: one
scan per head) decode one token with the
cached recurrent state, but run a forward of several new tokens through their module's `mamba_selective_scan`,
which starts from a zero state (the CUDA kernel it stands in for takes no initial state). A chain of drafted
tokens after a cached prefix would then be computed as if nothing came before it: wrong logits, only a few
1e-4 off on a tiny random model, which is how Jamba passed a tolerance-based probe.

`continued_scans(model)` runs a forward with each such mixer's scan started from the state its layer holds in
the cache: a pre-hook on the mixer reads `cache.get_recurrent_state(layer)` for a forward of several tokens,
and the module's scan function, wrapped once, runs the same recurrence from it. Position by position these are
the operations of the single-token update `generate` decodes with: dt = softplus(dt + bias), the state
h <- exp(dt A) h + (dt B) x, the output C h + D x gated by silu(z). With no state set (every forward outside
the context, in any thread) the wrapper calls the original function.
"""

from __future__ import annotations

import contextvars
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

# model_type -> (the module whose `mamba_selective_scan` its mixers call, the mixer class in it)
RESTARTED_SCANS = {
    "mamba": ("transformers.models.mamba.modeling_mamba", "MambaMixer"),
    "falcon_mamba": ("transformers.models.falcon_mamba.modeling_falcon_mamba", "FalconMambaMixer"),
    "jamba": ("transformers.models.jamba.modeling_jamba", "JambaMambaMixer"),
    "zamba": ("transformers.models.zamba.modeling_zamba", "ZambaMambaMixer"),  # a scan per head, in head order
}

# the states the scans of the mixer now running start from, in call order (None: from zero)
_INITIAL: contextvars.ContextVar[Iterator[torch.Tensor] | None] = contextvars.ContextVar("opttree_scan_state",
                                                                                       default=None)


def restarts_scan(model: PreTrainedModel) -> bool:
    """Whether the model's multi-token forward restarts a Mamba-1 scan from zero (what `continued_scans` mends)."""
    return model.config.get_text_config().model_type in RESTARTED_SCANS


_MIXERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its Mamba-1 mixers ([] for others)


def _mixers(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The model's Mamba-1 mixers, found once per model (their module's scan wrapped on the way)."""
    if model not in _MIXERS:
        mixers = []
        if restarts_scan(model):
            module_name, mixer_name = RESTARTED_SCANS[model.config.get_text_config().model_type]
            module = sys.modules[module_name]  # imported: the model is built from it
            _wrap_scan(module)
            mixers = [m for m in model.modules() if isinstance(m, getattr(module, mixer_name))]
        _MIXERS[model] = mixers
    return _MIXERS[model]


@contextmanager
def continued_scans(model: PreTrainedModel) -> Iterator[None]:
    """Within: the model's Mamba-1 mixers start a scan of several tokens from their cached state. A no-op for
    other models."""
    mixers = _mixers(model)
    if not mixers:
        yield
        return
    hooks = [mixer.register_forward_pre_hook(_capture_state, with_kwargs=True) for mixer in mixers]
    token = _INITIAL.set(None)
    try:
        yield
    finally:
        _INITIAL.reset(token)
        for hook in hooks:
            hook.remove()


def _capture_state(mixer, args: tuple, kwargs: dict) -> None:
    """Before a mixer's forward: the states its scans start from (None: from zero, as transformers does).
    A state (B, I, S) is one scan's; Zamba's (B, heads, I / heads, S) is one scan per head, run in head order."""
    hidden = args[0] if args else kwargs["hidden_states"]  # (B, Q, H)
    cache = kwargs.get("cache")
    state = cache.get_recurrent_state(mixer.layer_idx) if cache is not None and hidden.shape[1] > 1 else None
    _INITIAL.set(None if state is None else iter([state] if state.dim() == 3 else state.unbind(1)))


def _wrap_scan(module) -> None:
    original = module.mamba_selective_scan
    if getattr(original, "continues_state", False):
        return

    def scan(*args, **kwargs):
        states = _INITIAL.get()
        if states is None:
            return original(*args, **kwargs)
        state = next(states, None)
        if state is None:  # more scans than the captured state has parts: a mixer this module does not know
            raise RuntimeError("a Mamba-1 mixer ran more scans than its cached state has heads")
        return scan_from(state, *args, **kwargs)

    scan.continues_state = True
    module.mamba_selective_scan = scan


def scan_from(state: torch.Tensor, hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
              delta_bias: torch.Tensor | None = None, delta_softplus: bool = False, return_last_state: bool = False,
              **_):
    """transformers' `mamba_selective_scan` (its arguments, its recurrent form) from `state` (B, I, S) instead
    of zeros. hidden_states, dt, z: (B, I, Q); A: (I, S); B, C: (B, S, Q) -> (B, I, Q) [, last state (B, I, S)]."""
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    B, C = B.transpose(1, 2), C.transpose(1, 2)  # (B, Q, S)
    decay = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # (B, I, Q, S)
    inputs = dt[:, :, :, None] * B[:, None, :, :].float() * hidden_states[:, :, :, None].float()  # (B, I, Q, S)
    outputs = []
    for i in range(hidden_states.shape[2]):
        state = decay[:, :, i] * state + inputs[:, :, i]
        outputs.append(torch.matmul(state.to(hidden_states.dtype), C[:, i, :].unsqueeze(-1))[:, :, 0])
    out = torch.stack(outputs, dim=-1)  # (B, I, Q)
    if D is not None:
        out = out + hidden_states * D[None, :, None]
    if z is not None:
        out = out * F.silu(z)
    return (out, state) if return_last_state else out
