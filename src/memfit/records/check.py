"""Stability-check results: verdicts per precision, run curves, where values went non-finite."""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.records.base import Record

__all__ = ["ModuleRange", "NonFinite", "PrecisionCheck", "RunCurve", "StabilityReport"]


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
    levers: list[str] = field(default_factory=list)
    """Levers (:mod:`memfit.levers`) the precision runs used; the fp32 runs use none."""
