"""The plots say what they show: a budget line wherever a budget is given, legends that cover
no data, short labels, one logarithmic time axis for the bench, the device named once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from memfit.benchmarking.plot import bench_figure
from memfit.records import BenchPoint, StepMetrics
from memfit.report.plots import loss_figure, memory_figure

_MIB = 2**20
_DEVICE = "cpu (AMD EPYC (2 cores))"


@pytest.fixture
def close() -> Iterator[list[Any]]:
    figs: list[Any] = []
    yield figs
    for fig in figs:
        plt.close(fig)


def _outside(fig: Any) -> bool:
    """The legend's box and the axes' box do not overlap."""
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    a, b = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
    return min(a.x1, b.x1) <= max(a.x0, b.x0) or min(a.y1, b.y1) <= max(a.y0, b.y0)


def _bench(n: int, slow: float = 1.0) -> list[BenchPoint]:
    """``n`` fp32 points and, when ``slow`` > 1, one bf16 point ``slow`` times slower."""
    pts = [
        BenchPoint(
            "fp32/none" if i == 0 else f"fp32/mode{i}",
            "fp32",
            "none" if i == 0 else f"mode{i}",
            peak_bytes=(30 - 2 * i) * _MIB,
            step_seconds=0.1 + 0.01 * i,
            on_front=i == 0,
        )
        for i in range(n)
    ]
    if slow > 1:
        pts.append(BenchPoint("bf16/full", "bf16", "full", peak_bytes=12 * _MIB, step_seconds=0.1 * slow))
    return pts


@pytest.mark.parametrize(("n", "slow"), [(2, 1.0), (6, 1.0), (6, 20.0)])
def test_bench_has_one_log_time_axis_and_names_the_device_once(n: int, slow: float, close: list[Any]) -> None:
    fig = bench_figure(_bench(n, slow), budget_bytes=20 * _MIB, title=_DEVICE)
    close.append(fig)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log", "a few points or many, one log axis for the time"
    title = ax.get_title()
    assert title.count("AMD EPYC") == 1 and "))))" not in title and ")))" not in title, title
    budget = [a.get_label() for a in ax.get_lines()] + [t.get_text() for t in ax.texts]
    assert any(b.startswith(("budget", "\u2190 budget")) for b in budget), "no budget drawn"
    assert _outside(fig), "the legend covers points"
    lo, hi = ax.get_ylim()
    ys = [p.step_seconds * 1e3 for p in _bench(n, slow)]
    assert lo < min(ys) and max(ys) < hi
    assert len([t for t in ax.get_yticks() if lo <= t <= hi]) >= 3, "too few time ticks to read"


def test_bench_right_axis_reads_the_ratio_to_the_baseline(close: list[Any]) -> None:
    fig = bench_figure(_bench(4, 20.0), title="cpu")
    close.append(fig)
    ax = fig.axes[0]
    right = [c for c in ax.child_axes if "relative to fp32/none" in c.get_ylabel()]
    assert right, "no ratio axis"
    labels = [t.get_text() for t in right[0].get_yticklabels()]
    assert "1x" in labels and "10x" in labels, labels


def test_memory_plot_draws_the_budget_and_keeps_the_legend_off_it(close: list[Any]) -> None:
    parts = {"params": 5 * _MIB, "grads": 0, "optimizer": 10 * _MIB, "activations": 20 * _MIB}
    parts["temporaries"] = _MIB
    bars = {"baseline": parts, "memfit": {**parts, "activations": 5 * _MIB}}
    fig = memory_figure(bars, budget_bytes=25 * _MIB)
    close.append(fig)
    ax = fig.axes[0]
    budget = [line for line in ax.get_lines() if line.get_label().startswith("budget")]
    assert budget and budget[0].get_ydata()[0] == pytest.approx(25.0)
    assert _outside(fig), "the legend covers the bars or the budget line"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "grads: 0 at the peak" in labels and "grads" not in labels, labels


def test_loss_plot_keeps_labels_short_and_the_legend_beside_the_curves(close: list[Any]) -> None:
    long = "memfit (bf16, planned under 13.30 MiB: full 2, keep 2 of 4 blocks)"
    runs = {
        long: [StepMetrics(step=i, loss=5 - i / 10, val_loss=4.0 if i == 9 else None) for i in range(1, 10)],
        "baseline (fp32, no checkpointing)": [StepMetrics(step=i, loss=5.0 - i / 10) for i in range(1, 5)],
    }
    fig = loss_figure(runs, title="demo")
    close.append(fig)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["memfit", "baseline", "train", "validation"], labels
    assert _outside(fig)
    assert any("keep 2 of 4 blocks" in t.get_text() for t in fig.texts), "the run's details are gone"


def test_loss_plot_names_the_raw_line_under_the_smoothed_one(close: list[Any]) -> None:
    """Issue 37: loss.png drew each step's loss faintly under the smoothed line, unnamed."""
    runs = {"memfit": [StepMetrics(step=i, loss=5 - i / 100 + (i % 3) / 10) for i in range(1, 61)]}
    fig = loss_figure(runs)
    close.append(fig)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["memfit", "train (smoothed)", "train (each step)"], labels
    raw, smooth = fig.axes[0].lines[:2]
    assert list(raw.get_ydata()) == [m.loss for m in runs["memfit"]]
    assert raw.get_alpha() < 1 and smooth.get_alpha() is None  # faint under the smoothed line


def test_check_plot_shows_each_precision_where_they_coincide(tmp_path: Any, close: list[Any]) -> None:
    """Issue 37: bf16 and fp16 drawn plain on fp32 hid each other; each has its own dashes and marker."""
    from memfit.records import PrecisionCheck, RunCurve, StabilityReport
    from memfit.report.check_report import plot_check

    losses: list[float | None] = [5.0 - i / 10 for i in range(30)]

    def curve(name: str, precision: str, shift: float = 0.0) -> RunCurve:
        return RunCurve(name, precision, [v + shift for v in losses if v is not None], scales=[1.0] * 30)

    checks = {p: PrecisionCheck(p, "PASS", [], curve(p, p)) for p in ("bf16", "fp16")}
    report = StabilityReport("PASS", checks, curve("fp32", "fp32"), curve("noise", "fp32", 0.05), 0.05)
    saved: list[Any] = []
    original = plt.Figure.savefig

    def keep(fig: Any, *args: Any, **kwargs: Any) -> None:
        saved.append(fig)
        original(fig, *args, **kwargs)

    plt.Figure.savefig = keep  # type: ignore[method-assign]
    try:
        plot_check(report, tmp_path / "check.png")
    finally:
        plt.Figure.savefig = original  # type: ignore[method-assign]
    lines = {ln.get_label(): ln for ln in saved[0].axes[0].lines}
    drawn = ["fp32", "bf16 (PASS)", "fp16 (PASS)"]
    looks = {(lines[k].get_linestyle(), lines[k].get_marker(), lines[k].get_linewidth()) for k in drawn}
    assert len(looks) == 3, looks  # three lines on top of each other, each still seen
