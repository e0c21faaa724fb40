"""How a draft lines up with its target, measured on text the target writes itself.

`paired_logits` continues calibration prompts with the target and returns both models' logits at
every continuation position. From them come Sequoia's positional acceptance vector
(`policies.sequoia.acceptance_vector`) and the draft temperature that calibrates p-hat
(`fit_draft_temperature`), both saved by `opttree calibrate`.
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import torch
from transformers import PreTrainedModel

from .step.drafters.model import on_target_vocab
from .step.sampling import Warp, target_probs

TEMPERATURE_RANGE = (0.05, 20.0)  # where fit_draft_temperature searches
RELIABILITY_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@torch.inference_mode()
def paired_logits(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompts_ids: Sequence[torch.Tensor],
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    new_tokens: int = 64,
    seed: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per prompt ((T,) or (1, T)): the target continues it by `new_tokens` tokens (greedy at
    temperature 0, sampled otherwise), then one forward of each model over prompt + continuation.
    Yields float32 (target logits (P, V), draft logits (P, V)) at the P positions that predict the
    continuation's tokens, on the CPU; a padded (or shorter) draft's logits over the target's V ids."""
    from .speculator import generate

    for i, prompt in enumerate(prompts_ids):
        prompt = torch.as_tensor(prompt).view(-1)
        out = generate(target, prompt, tree="ar", max_new_tokens=new_tokens, temperature=temperature,
                       top_k=top_k, top_p=top_p, seed=seed + i)
        ids = out.sequences  # (1, T + new)
        start = prompt.shape[0] - 1  # the position that predicts the first new token
        target_logits = target(input_ids=ids).logits[0, start:-1]
        rows = draft.get_input_embeddings().weight.shape[0]  # a shorter draft sees the ids past it as its last row
        draft_logits = draft(input_ids=ids.to(draft.device).clamp(max=rows - 1)).logits[0, start:-1]
        draft_logits = on_target_vocab(draft_logits.float().cpu(), target_logits.shape[-1])  # padded vocabularies
        yield target_logits.float().cpu(), draft_logits  # the fits run on the host


def draft_cross_entropy(target_logits: torch.Tensor, draft_logits: torch.Tensor, draft_temperature: float,
                        temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> float:
    """Mean cross-entropy of what the verifier accepts under the draft's p-hat at `draft_temperature`.

    Temperature 0: -log q(target's argmax); a child is accepted iff it is that token. Temperature > 0:
    the soft cross-entropy against the target's warped distribution p, the probability that the
    verifier accepts a drafted token x being p(x); the draft's logits are divided by the draft
    temperature first, then warped like the target's (as the engine does). Logits: (P, V).
    """
    scaled = draft_logits / draft_temperature
    if temperature == 0:
        choice = target_logits.argmax(dim=-1, keepdim=True)  # (P, 1)
        return float(-scaled.log_softmax(dim=-1).gather(1, choice).mean())
    p = target_probs(target_logits, Warp(temperature, top_k, top_p))  # (P, V)
    logq = (scaled / temperature).log_softmax(dim=-1)  # (P, V)
    return float(-(p * logq.clamp(min=torch.finfo(logq.dtype).min)).sum(dim=-1).mean())


def fit_draft_temperature(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], temperature: float = 0.0,
                          top_k: int = 0, top_p: float = 1.0, tolerance: float = 1e-3) -> float:
    """The draft temperature that minimises `draft_cross_entropy` over all positions of `pairs`
    (temperature scaling, as in classifier calibration). The cross-entropy is convex in 1 / draft
    temperature, so a golden-section search over TEMPERATURE_RANGE finds the optimum."""
    target_logits = torch.cat([t for t, _ in pairs])
    draft_logits = torch.cat([d for _, d in pairs])
    if target_logits.shape[0] == 0:
        raise ValueError("no positions to fit the draft temperature on (empty continuations)")

    def loss(inverse: float) -> float:
        return draft_cross_entropy(target_logits, draft_logits, 1 / inverse, temperature, top_k, top_p)

    lo, hi = 1 / TEMPERATURE_RANGE[1], 1 / TEMPERATURE_RANGE[0]  # over inverse temperatures
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = loss(a), loss(b)
    while hi - lo > tolerance * (lo + hi) / 2:
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = loss(b)
    return 2 / (lo + hi)


def reliability(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], draft_temperature: float = 1.0,
                bins: Sequence[float] = RELIABILITY_BINS) -> list[dict]:
    """A reliability table of the draft's first choice at temperature 0: positions binned by the
    draft's top probability (logits / draft_temperature); per bin, how many, the mean stated
    probability, and how often the first choice is the target's argmax (what greedy verification
    accepts). A calibrated draft has stated ~= accepted in every bin."""
    target_logits = torch.cat([t for t, _ in pairs])
    draft_logits = torch.cat([d for _, d in pairs])
    top = (draft_logits / draft_temperature).softmax(dim=-1).max(dim=-1)  # (P,)
    hit = (top.indices == target_logits.argmax(dim=-1)).double()  # (P,)
    which = torch.bucketize(top.values, torch.tensor(bins[1:-1]), right=True)  # (P,) bin index
    rows = []
    for i, (lo, hi) in enumerate(zip(bins, bins[1:])):
        member = which == i
        count = int(member.sum())
        rows.append({"from": lo, "to": hi, "positions": count,
                     "stated": float(top.values[member].mean()) if count else None,
                     "accepted": float(hit[member].mean()) if count else None})
    return rows
