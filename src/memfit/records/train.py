"""What one training step did: :class:`StepMetrics`, one line of ``metrics.jsonl``."""

from __future__ import annotations

from dataclasses import dataclass

from memfit.records.base import Record

__all__ = ["StepMetrics"]


@dataclass
class StepMetrics(Record):
    """What one training step of :class:`memfit.Trainer` did: one line of ``metrics.jsonl``.

    ``peak_bytes`` is set on the steps whose memory was tracked (every step on a GPU, from
    the CUDA allocator; chosen steps on a CPU, from MemTracker) and None on the others.
    ``val_loss`` is set on the steps after which the model was evaluated.
    """

    step: int
    loss: float
    lr: float = 0.0
    grad_norm: float | None = None
    scale: float = 1.0
    skipped: bool = False
    samples: int = 0
    tokens: int = 0
    seconds: float = 0.0
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    peak_bytes: int | None = None
    val_loss: float | None = None
    tracked: bool = False
    """MemTracker watched this step (it ran slower; timings leave it out)."""
