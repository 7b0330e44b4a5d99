"""What one measured training step cost: :class:`MemoryReport` and the roles its peak splits into."""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.records.base import Record

__all__ = ["BREAKDOWN_KEYS", "MemoryReport"]

#: The parts a step's memory is split into, in the order tables and plots show them.
BREAKDOWN_KEYS: tuple[str, ...] = ("params", "grads", "optimizer", "activations", "temporaries")


@dataclass
class MemoryReport(Record):
    """What one steady-state training step costs, as PyTorch's own tracking counts it.

    ``breakdown`` splits the peak into :data:`BREAKDOWN_KEYS` at the moment of the peak, so
    its values add up to ``peak_bytes``. ``activation_bytes`` is what the forward pass
    keeps for backward (taken when the loss is ready), whether or not that is the peak.
    """

    peak_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)
    activation_bytes: int = 0
    step_seconds: float = 0.0
    device: str = "cpu"
    precision: str = "fp32"
    tracker: str = "MemTracker"
