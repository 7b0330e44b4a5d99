"""PASS / WARN / FAIL from the numbers of a stability check: a pure function over records.

Trade-off: thresholds loose enough that a healthy model passes despite the natural noise
of training, tight enough that a precision that changes the result is flagged. Every
threshold is relative to something measured in the same check (the noise band of two fp32
runs, fp16's largest value, the number of steps), so one set works across models.

Example:
    >>> from memfit.records import PrecisionCheck, RunCurve
    >>> pc = PrecisionCheck("bf16", "", [], RunCurve("bf16", "bf16", eval_loss=2.0), loss_delta=0.001,
    ...                     band_multiple=0.5, grad_norm_ratio=1.01)
    >>> judge(pc)[0]
    'PASS'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memfit.records import PrecisionCheck

__all__ = ["VERDICTS", "Thresholds", "judge", "worst"]

VERDICTS = ("PASS", "WARN", "FAIL")


@dataclass(kw_only=True, frozen=True)
class Thresholds:
    """Where PASS ends and WARN and FAIL begin (see docs/check.md, "Verdict thresholds")."""

    warn_band: float = 2.0
    """WARN when the final-loss difference to fp32 exceeds this many noise bands."""
    fail_band: float = 5.0
    """FAIL when it exceeds this many noise bands."""
    band_floor: float = 0.002
    """The noise band is at least this fraction of the fp32 loss (one noise pair can be close by chance)."""
    grad_norm_ratio: float = 1.25
    """WARN when the median gradient-norm ratio to fp32 is above this or below its inverse."""
    warn_skip_fraction: float = 0.2
    """WARN when the loss scaler skipped more than this fraction of the steps."""
    fail_skip_fraction: float = 0.5
    """FAIL when it skipped more than this fraction: most updates were lost."""
    fp16_headroom: float = 0.5
    """WARN when a module's largest |activation| exceeds this fraction of 65504."""
    underflow_fraction: float = 0.05
    """WARN when a module loses more than this fraction of its output gradients to fp16 underflow."""

    def __post_init__(self) -> None:
        if not 0 < self.warn_band <= self.fail_band:
            raise ValueError("thresholds need 0 < warn_band <= fail_band.")
        if not 0 <= self.warn_skip_fraction <= self.fail_skip_fraction <= 1:
            raise ValueError("thresholds need 0 <= warn_skip_fraction <= fail_skip_fraction <= 1.")

    def to_dict(self) -> dict[str, float]:
        """The thresholds as a plain dict (for reports)."""
        return dataclasses.asdict(self)


def worst(verdicts: list[str]) -> str:
    """The worst of several verdicts (PASS for none)."""
    return max(verdicts, key=VERDICTS.index, default="PASS")


def judge(pc: PrecisionCheck, t: Thresholds | None = None) -> tuple[str, list[str]]:
    """The verdict on one precision and the reasons for it, in words.

    Args:
        pc: the measured numbers (its own ``verdict`` and ``reasons`` are ignored).
        t: thresholds (default :class:`Thresholds`).

    Returns:
        ``(verdict, reasons)``: FAIL and WARN reasons name the number and the limit it
        crossed; a PASS lists what was checked.
    """
    t = t or Thresholds()
    fail: list[str] = []
    warn: list[str] = []
    ok: list[str] = []
    steps = max(len(pc.run.losses), 1)
    if pc.first_nonfinite is not None:
        nf = pc.first_nonfinite
        fail.append(
            f"a non-finite value ({nf.value}) appeared at step {nf.step} in the {nf.phase} pass of "
            f"module {nf.module!r} ({nf.dtype})"
        )
    if pc.run.eval_loss is None:
        fail.append("the final weights give a non-finite loss")
    skip_fraction = pc.skipped_steps / steps
    if skip_fraction > t.fail_skip_fraction:
        fail.append(
            f"the loss scaler skipped {pc.skipped_steps} of {steps} steps (limit {t.fail_skip_fraction:.0%})"
        )
    elif skip_fraction > t.warn_skip_fraction:
        warn.append(
            f"the loss scaler skipped {pc.skipped_steps} of {steps} steps (limit {t.warn_skip_fraction:.0%})"
        )
    elif pc.skipped_steps:
        ok.append(
            f"the loss scaler skipped {pc.skipped_steps} of {steps} steps (limit {t.warn_skip_fraction:.0%})"
        )
    if pc.final_scale < 1.0:
        fail.append(f"the loss scale fell to {pc.final_scale:g} (< 1): gradients overflow fp16 even unscaled")
    if pc.band_multiple is not None:
        text = f"final loss differs from fp32 by {pc.band_multiple:.2f} noise bands"
        if pc.band_multiple > t.fail_band:
            fail.append(f"{text} (limit {t.fail_band:g})")
        elif pc.band_multiple > t.warn_band:
            warn.append(f"{text} (limit {t.warn_band:g})")
        else:
            ok.append(f"{text}, within {t.warn_band:g}")
    r = pc.grad_norm_ratio
    if r is not None:
        text = f"median gradient-norm ratio to fp32 is {r:.3f}"
        if r > t.grad_norm_ratio or r < 1 / t.grad_norm_ratio:
            warn.append(f"{text} (outside {1 / t.grad_norm_ratio:.2f}..{t.grad_norm_ratio:.2f})")
        else:
            ok.append(text)
    for m in pc.modules:
        if m.fp16_fraction is not None and m.fp16_fraction > t.fp16_headroom:
            warn.append(
                f"module {m.module!r} reaches |activation| {m.max_abs:.4g}, {m.fp16_fraction:.0%} of fp16's "
                f"maximum 65504 (limit {t.fp16_headroom:.0%})"
            )
        u = m.grad_underflow_fraction
        if u is not None and u > t.underflow_fraction:
            warn.append(
                f"module {m.module!r} loses {u:.1%} of its output gradients to fp16 underflow at loss scale "
                f"{pc.final_scale:g} (limit {t.underflow_fraction:.0%})"
            )
    if fail:
        return "FAIL", fail + warn
    if warn:
        return "WARN", warn
    return "PASS", ok
