"""Plain records that cross module borders, each with a JSON round-trip.

Measuring produces them, planning reads and writes them, reporting prints them. They hold
numbers only (no tensors, no modules), so a record written on one machine can be read,
planned over and reported on another.

Example:
    >>> r = MemoryReport(peak_bytes=10, breakdown={"params": 4, "activations": 6})
    >>> MemoryReport.from_json(r.to_json()) == r
    True
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = [
    "BREAKDOWN_KEYS",
    "CHECKPOINT_MODES",
    "BenchPoint",
    "BlockStats",
    "MemoryReport",
    "Plan",
    "Profile",
    "Record",
    "StepMetrics",
]

#: The parts a step's memory is split into, in the order tables and plots show them.
BREAKDOWN_KEYS: tuple[str, ...] = ("params", "grads", "optimizer", "activations", "temporaries")
#: Checkpointing modes of one block, from most memory and least compute to the reverse.
CHECKPOINT_MODES: tuple[str, ...] = ("none", "selective", "full")

_R = TypeVar("_R", bound="Record")


def _decode(tp: Any, value: Any) -> Any:
    """Rebuild ``value`` (parsed JSON) as type ``tp`` (nested records, lists, dicts)."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _decode(args[0], value) if len(args) == 1 else value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and issubclass(tp, Record):
        return tp.from_dict(value)
    if origin is list:
        return [_decode(typing.get_args(tp)[0], v) for v in value]
    if origin is tuple:
        targs = typing.get_args(tp)
        if len(targs) == 2 and targs[1] is Ellipsis:
            return tuple(_decode(targs[0], v) for v in value)
        return tuple(_decode(a, v) for a, v in zip(targs, value, strict=True))
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        return {k: _decode(val_tp, v) for k, v in value.items()}
    return value


class Record:
    """Mixin: ``to_dict`` / ``from_dict`` / ``to_json`` / ``from_json`` for dataclasses."""

    def to_dict(self) -> dict[str, Any]:
        """Return the record as JSON-ready nested dicts and lists."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_json(self, indent: int | None = 2) -> str:
        """Return the record as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls: type[_R], data: dict[str, Any]) -> _R:
        """Build the record from :meth:`to_dict` output; unknown keys are an error."""
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
        return cls(**{k: _decode(hints[k], v) for k, v in data.items()})

    @classmethod
    def from_json(cls: type[_R], text: str) -> _R:
        """Build the record from :meth:`to_json` output."""
        return cls.from_dict(json.loads(text))


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


@dataclass
class BlockStats(Record):
    """Measured costs of one block (or of everything outside the blocks).

    Dicts are keyed by checkpointing mode (:data:`CHECKPOINT_MODES`).
    """

    name: str
    param_bytes: int = 0
    saved_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes the block keeps from its forward until its backward, per mode."""
    backward_peak_bytes: dict[str, int] = field(default_factory=dict)
    """Transient bytes above what is kept while its backward runs (recompute included)."""
    forward_seconds: float = 0.0
    backward_seconds: dict[str, float] = field(default_factory=dict)
    """Backward time per mode, recompute included."""
    forward_flops: int = 0
    backward_flops: dict[str, int] = field(default_factory=dict)
    """Backward FLOPs per mode, recompute included."""


@dataclass
class Profile(Record):
    """Per-block costs of one training step: the planner's input."""

    precision: str
    device: str
    batch_size: int
    blocks: list[BlockStats]
    outside: BlockStats
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    optimizer_temp_bytes: int
    optimizer: str = "none"
    input_bytes: int = 0
    measured_peak_bytes: int = 0
    step_seconds: float = 0.0


@dataclass
class Plan(Record):
    """A decision: how to checkpoint each block, which precision, how many micro-batches.

    A Plan is plain data; :func:`memfit.apply` is the only thing that acts on it.
    """

    blocks: dict[str, str]
    precision: str = "fp32"
    micro_batches: int = 1
    predicted_peak_bytes: int = 0
    predicted_step_seconds: float = 0.0
    baseline_peak_bytes: int = 0
    baseline_step_seconds: float = 0.0
    budget_bytes: int = 0


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
