"""Per-generation statistics. Collected with `observe_step`; the engine never prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    steps: int = 0
    new_tokens: int = 0
    accepted_histogram: list[int] = field(default_factory=list)  # [a] = steps that accepted a draft tokens
    drafted_tokens: int = 0  # draft nodes sent to verification
    accepted_tokens: int = 0  # draft tokens kept (bonus excluded)
    time_s: float = 0.0  # wall time of the whole call, prefill included
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    def observe_step(self, drafted: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.new_tokens += emitted
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_histogram) <= accepted:
            self.accepted_histogram.extend([0] * (accepted + 1 - len(self.accepted_histogram)))
        self.accepted_histogram[accepted] += 1

    @property
    def mean_accepted_length(self) -> float:
        """New tokens per step, bonus included (plain decoding scores 1.0)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.time_s if self.time_s > 0 else 0.0

    @property
    def overhead_s(self) -> float:
        """Wall time that is neither prefill, drafting nor the verifying forward (acceptance, caches, Python)."""
        return max(self.time_s - self.prefill_s - self.draft_s - self.verify_s, 0.0)

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("mean_accepted_length", "acceptance_rate", "tokens_per_second", "overhead_s"):
            out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class RowCost:
    """What one row of a batch gives and costs a step when it drafts, from its own earlier steps that
    drafted: for an allocator that may let it decode plainly (`batch_sizing.SizedBudget.plain`)."""

    sized: bool  # its settings and seed let the batch size its tree, or skip it
    sampled: bool  # temperature > 0
    budget: int  # its own draft-node budget
    tokens: float | None  # tokens emitted per drafting step (None: not measured yet)
    draft_ms: float | None  # ms of drafting (and observing) per drafting step
    plain_run: int = 0  # steps it has decoded plainly in a row, up to this one

