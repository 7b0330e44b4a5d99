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
    "STRATEGY_ORDER",
    "BenchPoint",
    "BlockStats",
    "Estimate",
    "EstimateEntry",
    "MemoryReport",
    "ModuleRange",
    "NonFinite",
    "Plan",
    "PrecisionCheck",
    "Profile",
    "Record",
    "RunCurve",
    "StabilityReport",
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

    Dicts are keyed by checkpointing mode (:data:`CHECKPOINT_MODES`); a number for mode
    ``m`` was taken with *every* block in mode ``m``. Memory numbers are differences of
    MemTracker totals (all categories) in bytes, so they add up; see :class:`Profile` for
    how a simulator adds them up to the step's peak.

    For a block:

    - ``saved_bytes[m]``: bytes the block's forward created that are still alive when the
      whole forward ends: what it keeps until its backward (for ``full``: its input; for
      ``selective``: also matmul/attention/conv outputs; for ``none``: everything autograd
      saves). Its output counts here when the next block keeps it.
    - ``held_bytes[m]``: total when its forward returns minus total when it starts: the
      saved bytes plus what it holds only until the forward ends (autocast's cached weight
      casts, for example).
    - ``forward_peak_bytes[m]``: highest total while its forward runs minus the total when
      it starts (so at least ``held_bytes[m]``).
    - ``backward_peak_bytes[m]``: highest total while its backward runs (recompute
      included) minus what is kept then: parameters, optimizer state, the gradients that
      exist when its backward starts, ``Profile.outside_before_kept_bytes`` and the saved
      bytes of this block and every block before it. It covers the recomputed
      activations, the incoming and outgoing activation gradients, its own parameter
      gradients and weight-gradient temporaries.

    For the outside part (everything not in a block: embeddings, final norm, head, loss):

    - ``saved_bytes[m]``: activation total at the end of the forward minus the blocks'
      ``saved_bytes[m]``: what the outside keeps for backward (with the batch input).
    - ``forward_peak_bytes[m]``: highest (total - parameters and optimizer state - blocks'
      held bytes of the blocks whose forward has finished) at any moment of the forward
      outside every block: the loss and head transients on top of what the outside keeps.
    - ``backward_peak_bytes[m]``: highest (total - parameters and optimizer state - saved
      bytes of blocks not yet backwarded - gradients of blocks already backwarded) at any
      moment of the backward outside every block (loss, head and embedding backward).
    """

    name: str
    param_bytes: int = 0
    """Bytes of the parameters and buffers of this part."""
    saved_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes the part keeps from its forward until its backward, per mode."""
    backward_peak_bytes: dict[str, int] = field(default_factory=dict)
    """Transient bytes above what is kept while its backward runs (recompute included)."""
    forward_seconds: float = 0.0
    """Median forward time (plain forward; the same in every mode)."""
    backward_seconds: dict[str, float] = field(default_factory=dict)
    """Median backward time per mode, recompute included."""
    forward_flops: int = 0
    """FLOPs of its forward (FlopCounterMode; ops it has no formula for count 0)."""
    backward_flops: dict[str, int] = field(default_factory=dict)
    """Backward FLOPs per mode, recompute included."""
    grad_bytes: int = 0
    """Bytes of its parameters' gradients (created during its backward, kept to the step)."""
    forward_peak_bytes: dict[str, int] = field(default_factory=dict)
    """Transient peak of its forward above the total when it started, per mode."""
    forward_fixed_bytes: int = 0
    """Part of ``forward_peak_bytes`` that does not shrink with micro-batches (FSDP2's
    all-gathered parameters; 0 for a model on one process)."""
    backward_fixed_bytes: int = 0
    """Part of ``backward_peak_bytes``, beyond ``grad_bytes``, that does not shrink with
    micro-batches (FSDP2's gathered parameters and whole gradients before reduce-scatter)."""
    held_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes it holds when its forward returns (saved bytes + what the forward's end frees)."""


@dataclass
class Profile(Record):
    """Per-block costs of one training step: the planner's input.

    All bytes are MemTracker's counts on a CPU (CUDA allocator on a GPU for the measured
    peak) for one steady-state step at ``batch_size`` in ``precision``. The step holds
    ``fixed = param_bytes + optimizer_bytes`` throughout. With blocks ``0..n-1`` in forward
    order, block ``i`` in mode ``m_i``, ``S(i) = sum(saved_bytes[m_j] for j <= i)``,
    ``H(i) = sum(held_bytes[m_j] for j <= i)`` and
    ``G(i) = early_grad_bytes + sum(grad_bytes of blocks j > i)``, the step's peak is the
    largest of:

    - forward of block i: ``fixed + outside_before_bytes + H(i-1) + forward_peak_bytes[m_i]``
    - forward outside: ``fixed + H(n-1) + outside.forward_peak_bytes[m]``
    - backward of block i: ``fixed + G(i) + outside_before_kept_bytes + S(i) + backward_peak_bytes[m_i]``
    - backward outside: ``fixed + S(n-1) + outside.backward_peak_bytes[m]``
    - backward before the blocks: ``fixed + G(-1) + outside_before_backward_bytes``
    - optimizer step: ``fixed + grad_bytes + optimizer_temp_bytes``

    :func:`memfit.measure.stepmodel.step_peak` implements this.

    For a uniform mode this reproduces ``measured_peak_bytes`` (mode none) to within a few
    bytes; the tests check it for every mode and for mixed modes.
    """

    precision: str
    device: str
    batch_size: int
    blocks: list[BlockStats]
    outside: BlockStats
    param_bytes: int
    """Parameters and buffers (held all step)."""
    grad_bytes: int
    """All parameter gradients at the end of the backward."""
    optimizer_bytes: int
    """Optimizer state (held all step; created by a warm-up step before measuring)."""
    optimizer_temp_bytes: int
    """Highest total during clipping and the optimizer step minus the total before it."""
    optimizer: str = "none"
    """The optimizer's class name, or ``none``."""
    input_bytes: int = 0
    """Bytes of the batch's tensors. MemTracker on a CPU counts the model's input tensor
    (in ``outside_before_bytes``) but not tensors only the loss function reads."""
    measured_peak_bytes: int = 0
    """Peak of the model with no checkpointing, measured by :func:`memfit.measure`."""
    step_seconds: float = 0.0
    """Median step time of the model with no checkpointing."""
    outside_before_bytes: int = 0
    """What the outside part holds when the first block starts (embedding output, input);
    kept until the embeddings' backward, after every block's backward."""
    outside_before_kept_bytes: int = 0
    """What the outside keeps for backward from before the blocks (embedding output, the
    input): alive when the forward ends and freed only after every block's backward."""
    early_grad_bytes: int = 0
    """Parameter gradients that exist when the last block's backward starts (final norm,
    head); tied weights accumulate later."""
    outside_before_backward_bytes: int = 0
    """Highest bytes above ``fixed``, ``early_grad_bytes`` and every block's gradients while
    the part before the blocks (stem, embeddings) runs its backward, after every block's
    backward: what it kept, the gradients it creates and its transients."""
    activation_bytes: int = 0
    """Activation total at the end of the forward with no checkpointing (blocks + outside)."""
    notes: list[str] = field(default_factory=list)
    """Caveats found while profiling (no blocks found, ops without FLOP formulas, ...)."""
    optimizer_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    """The optimizer state split by dtype, e.g. ``{"float32": ...}`` (step counters included)."""


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
    measured_peak_bytes: int = 0
    """The plan's peak as measured when it was made (0: not measured)."""
    notes: list[str] = field(default_factory=list)
    """What the user should know about the plan (e.g. BatchNorm sees micro-batches)."""


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


@dataclass
class NonFinite(Record):
    """Where the first non-finite value (inf or NaN) of a step appeared."""

    module: str
    """Qualified module name (``""`` is the model itself; ``"<loss>"`` the loss function)."""
    phase: str
    """``"forward"``, ``"loss"`` or ``"backward"``."""
    dtype: str
    """The dtype of the tensor that held it, e.g. ``"float16"``."""
    value: str = "inf"
    """``"inf"`` or ``"nan"``."""
    step: int = 0
    """The training step (1-based) it appeared in, 0 when not known."""


@dataclass
class ModuleRange(Record):
    """How close one module's values came to the limits of fp16."""

    module: str
    dtype: str
    """The dtype of the module's output under the checked precision."""
    max_abs: float | None
    """Largest absolute output value seen (None: non-finite)."""
    fp16_fraction: float | None
    """``max_abs / 65504`` (fp16's largest value): 1 or more overflows to inf."""
    grad_underflow_fraction: float | None = None
    """Fraction of non-zero output-gradient values that fp16 flushes to zero at the loss scale."""


@dataclass
class RunCurve(Record):
    """One training run of a stability check: what each step did."""

    name: str
    precision: str
    losses: list[float | None] = field(default_factory=list)
    """Training loss per step (None: not finite)."""
    grad_norms: list[float | None] = field(default_factory=list)
    """Gradient norm per step after unscaling (None: not finite)."""
    scales: list[float] = field(default_factory=list)
    """Loss scale used at each step (1.0 without a scaler)."""
    skipped: list[bool] = field(default_factory=list)
    """Steps the loss scaler skipped."""
    eval_loss: float | None = None
    """Loss of the final weights on the evaluation batches, computed in fp32."""
    seconds: float = 0.0


@dataclass
class PrecisionCheck(Record):
    """The verdict on one precision against fp32, with the numbers behind it."""

    precision: str
    verdict: str
    """``"PASS"``, ``"WARN"`` or ``"FAIL"``."""
    reasons: list[str]
    run: RunCurve
    loss_delta: float | None = None
    """``|eval_loss - fp32 eval_loss|`` (None: not finite)."""
    band_multiple: float | None = None
    """``loss_delta`` divided by the noise band."""
    grad_norm_ratio: float | None = None
    """Median over steps of this run's gradient norm over fp32's."""
    param_drift: float | None = None
    """``||w - w_fp32|| / ||w_fp32 - w_0||``: distance to the fp32 weights, relative to how far fp32 moved."""
    skipped_steps: int = 0
    final_scale: float = 1.0
    first_nonfinite: NonFinite | None = None
    modules: list[ModuleRange] = field(default_factory=list)
    """Per-module ranges (fp16), the closest to overflow first."""
    reference_run: RunCurve | None = None
    """The fp32 run compared with when the loss scaler skipped steps: it skips the same steps."""


@dataclass
class StabilityReport(Record):
    """Mixed precision against fp32: one verdict per precision and the overall one."""

    verdict: str
    by_precision: dict[str, PrecisionCheck]
    reference: RunCurve
    """The fp32 run every precision is compared with."""
    noise: RunCurve
    """A second fp32 run with another data order and seed: its distance is the noise band."""
    noise_band: float
    """How far two fp32 runs differ in final evaluation loss (floored, see thresholds)."""
    noise_param_drift: float | None = None
    """``param_drift`` of the second fp32 run, for scale."""
    steps: int = 0
    device: str = "cpu"
    hardware: list[str] = field(default_factory=list)
    """Device facts the check depends on (e.g. that fp16 is emulated here)."""
    thresholds: dict[str, float] = field(default_factory=dict)
    checkpointing: dict[str, str] = field(default_factory=dict)
    """Blocks checkpointed in the mixed-precision runs, ``{name: mode}``."""
    micro_batches: int = 1


#: Strategies from fastest-looking to slowest-looking: lower precision first (tensor-core
#: matmuls are 2-16x faster than fp32 on GPUs; bf16 needs no loss scaling), then less recompute.
STRATEGY_ORDER: tuple[tuple[str, str], ...] = tuple(
    (p, m) for p in ("bf16", "fp16", "fp32") for m in CHECKPOINT_MODES
)


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
        rank = {s: i for i, s in enumerate(STRATEGY_ORDER)}
        return sorted(self.entries, key=lambda e: rank.get((e.precision, e.mode), len(rank)))

    @property
    def fits(self) -> list[tuple[str, str]]:
        """(precision, mode) pairs whose peak fits ``device_memory``, fastest-looking first."""
        if self.device_memory is None:
            return []
        return [(e.precision, e.mode) for e in self.ordered() if e.peak_bytes <= self.device_memory]
