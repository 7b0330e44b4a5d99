"""One strategy measured by ``memfit.bench``: :class:`BenchPoint`."""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.records.base import Record

__all__ = ["BenchPoint"]


@dataclass
class BenchPoint(Record):
    """One strategy measured by :func:`memfit.bench`: its peak bytes, step time and FLOPs.

    Ratios are to ``baseline`` (normally ``fp32/none``) measured in the same run. A strategy
    that could not run has ``error`` set (the reason); it has no ratios and is never on the
    front (numbers measured before it failed, such as its peak, are kept).
    """

    strategy: str
    precision: str
    checkpointing: str
    peak_bytes: int = 0
    """Peak bytes of one steady-state step, from the same tracking as ``memfit.measure``."""
    breakdown: dict[str, int] = field(default_factory=dict)
    """The peak split into :data:`BREAKDOWN_KEYS`."""
    step_seconds: float = 0.0
    """Median of the timed steps."""
    step_times: list[float] = field(default_factory=list)
    """Every timed step, in seconds, in the order they ran (interleaved with the others)."""
    flops: int = 0
    """FLOPs of one step (forward, backward with recompute), by FlopCounterMode."""
    peak_ratio: float = 0.0
    """``peak_bytes`` over the baseline's."""
    time_ratio: float = 0.0
    """``step_seconds`` over the baseline's."""
    recompute_fraction: float = 0.0
    """``flops`` over the FLOPs of the same precision without checkpointing (1.0: no recompute)."""
    on_front: bool = False
    """No other strategy is both smaller (or equal) and faster (or equal), one of them strictly."""
    baseline: str = ""
    micro_batches: int = 1
    device: str = "cpu"
    tracker: str = "MemTracker"
    error: str = ""
    """Why the strategy failed; empty when it ran."""

    @property
    def ok(self) -> bool:
        """True when the strategy ran and was measured."""
        return not self.error
