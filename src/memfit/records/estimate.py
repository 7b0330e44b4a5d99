"""Predicted step memory for every precision x checkpointing mode: :class:`Estimate`."""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.records.base import Record
from memfit.records.profile import Profile
from memfit.vocab import STRATEGY_ORDER

__all__ = ["Estimate", "EstimateEntry"]


@dataclass
class EstimateEntry(Record):
    """The predicted step memory of one precision x checkpointing strategy."""

    precision: str
    mode: str
    peak_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)
    """The peak split into :data:`BREAKDOWN_KEYS`; adds up to ``peak_bytes``."""
    activation_bytes: int = 0
    """What the forward keeps for backward (as :attr:`MemoryReport.activation_bytes`)."""
    levers: list[str] = field(default_factory=list)
    """Levers (:mod:`memfit.levers`) this entry uses; empty for the plain strategies."""


@dataclass
class Estimate(Record):
    """Predicted peak bytes of a training step for every precision x checkpointing mode.

    Computed by :func:`memfit.estimate` under fake tensors with the same MemTracker
    accounting as :func:`memfit.measure`, so on the device type it ran on the numbers are
    what ``measure`` would report, without allocating the memory.
    """

    model: str
    param_count: int
    batch_size: int
    device: str
    optimizer: str
    entries: list[EstimateEntry]
    device_memory: int | None = None
    """Bytes available on the target device, if given."""
    assumptions: list[str] = field(default_factory=list)
    profiles: dict[str, Profile] = field(default_factory=dict)
    """Per precision, the memory numbers of a :class:`Profile` (times and FLOPs are 0), for
    planning a model too large to run; ``measured_peak_bytes`` is 0 (nothing was measured)."""
    seconds: float = 0.0
    """Wall time the estimate took."""
    with_levers: EstimateEntry | None = None
    """With ``levers``: the smallest step the levers allow
    (:func:`memfit.planning.lever_sets.smallest_with_levers`)."""

    def entry(self, precision: str, mode: str) -> EstimateEntry:
        """The entry of one strategy; KeyError names the strategies there are."""
        for e in self.entries:
            if e.precision == precision and e.mode == mode:
                return e
        have = ", ".join(f"{e.precision}/{e.mode}" for e in self.entries)
        raise KeyError(f"no estimate for {precision}/{mode}; estimated: {have}")

    def peak_bytes(self, precision: str, mode: str) -> int:
        """Predicted peak bytes of one step with this precision and checkpointing mode."""
        return self.entry(precision, mode).peak_bytes

    def breakdown(self, precision: str, mode: str) -> dict[str, int]:
        """The predicted peak split into params, grads, optimizer, activations, temporaries."""
        return dict(self.entry(precision, mode).breakdown)

    def ordered(self) -> list[EstimateEntry]:
        """Entries from fastest-looking to slowest-looking (:data:`STRATEGY_ORDER`)."""
        rank: dict[tuple[str, str], int] = {s: i for i, s in enumerate(STRATEGY_ORDER)}
        return sorted(self.entries, key=lambda e: rank.get((e.precision, e.mode), len(rank)))

    @property
    def fits(self) -> list[tuple[str, str]]:
        """(precision, mode) pairs whose peak fits ``device_memory``, fastest-looking first."""
        if self.device_memory is None:
            return []
        return [(e.precision, e.mode) for e in self.ordered() if e.peak_bytes <= self.device_memory]
