"""Summaries and Markdown reports of training runs, from their per-step metrics.

Trade-off: the "final train loss" is the mean of the last few steps, not the very last
step's loss, so one noisy batch does not decide it; the number of steps averaged is said.

Example:
    >>> from memfit.records import StepMetrics
    >>> rows = [StepMetrics(step=i, loss=5.0 - i, tokens_per_s=100.0) for i in range(1, 4)]
    >>> s = summarize(rows, window=2)
    >>> s.steps, s.final_loss, s.first_loss
    (3, 2.5, 4.0)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from memfit.budget import format_bytes
from memfit.records import BREAKDOWN_KEYS, MemoryReport, StepMetrics
from memfit.report.table import markdown_table

__all__ = ["RunSummary", "median_step_seconds", "memory_rows", "summarize", "training_report"]


@dataclass
class RunSummary:
    """What a run's metrics add up to."""

    steps: int
    first_loss: float
    final_loss: float
    """Mean loss of the last ``window`` steps."""
    window: int
    val_loss: float | None
    median_tokens_per_s: float
    skipped_steps: int
    peak_bytes: int | None


def _timed(history: Sequence[StepMetrics]) -> list[StepMetrics]:
    """The steps whose time means something: not the first (warm-up), not MemTracker's."""
    return [m for m in history[1:] if not m.tracked] or list(history)


def median_step_seconds(history: Sequence[StepMetrics]) -> float:
    """Median seconds per step, leaving out the first step and MemTracker-watched ones."""
    timed = _timed(history)
    return statistics.median(m.seconds for m in timed) if timed else math.nan


def summarize(history: Sequence[StepMetrics], window: int = 10) -> RunSummary:
    """Summarize a run's metrics (an empty history gives NaN losses)."""
    last = list(history[-window:])
    vals = [m.val_loss for m in history if m.val_loss is not None]
    peaks = [m.peak_bytes for m in history if m.peak_bytes is not None]
    rates = [m.tokens_per_s for m in _timed(history)]
    return RunSummary(
        steps=history[-1].step if history else 0,
        first_loss=history[0].loss if history else math.nan,
        final_loss=statistics.fmean(m.loss for m in last) if last else math.nan,
        window=len(last),
        val_loss=vals[-1] if vals else None,
        median_tokens_per_s=statistics.median(rates) if rates else 0.0,
        skipped_steps=sum(m.skipped for m in history),
        peak_bytes=max(peaks) if peaks else None,
    )


def memory_rows(reports: dict[str, MemoryReport]) -> list[list[str]]:
    """Rows of a breakdown table: one per part, one for the peak, a column per run."""
    rows = []
    for key in (*BREAKDOWN_KEYS, "peak"):
        cells = [key]
        for report in reports.values():
            value = report.peak_bytes if key == "peak" else report.breakdown.get(key, 0)
            cells.append(f"{value:,} ({format_bytes(value)})")
        rows.append(cells)
    return rows


def training_report(
    title: str,
    history: Sequence[StepMetrics],
    memory: MemoryReport | None,
    settings: dict[str, str],
    notes: Sequence[str] = (),
    images: Sequence[str] = (),
) -> str:
    """A Markdown report: settings, results, the memory breakdown, notes and ``images`` (file names)."""
    s = summarize(history)
    lines = [f"# {title}", "", "## Settings", ""]
    lines.append(markdown_table(["setting", "value"], [[k, v] for k, v in settings.items()]))
    results = [
        ["steps", str(s.steps)],
        ["first train loss", f"{s.first_loss:.4f}"],
        [f"final train loss (mean of last {s.window} steps)", f"{s.final_loss:.4f}"],
        ["final validation loss", "-" if s.val_loss is None else f"{s.val_loss:.4f}"],
        ["median tokens/s", f"{s.median_tokens_per_s:,.0f}"],
        ["skipped steps (fp16 overflow)", str(s.skipped_steps)],
    ]
    lines += ["", "## Results", "", markdown_table(["", "value"], results)]
    if memory is not None:
        lines += [
            "",
            f"## Memory of one steady-state step ({memory.tracker}, {memory.device}, {memory.precision})",
            "",
            markdown_table(["part", "bytes"], memory_rows({"run": memory})),
        ]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    for image in images:
        lines += ["", f"![{Path(image).stem}]({image})"]
    return "\n".join(lines) + "\n"
