"""The bench's picture: peak memory (x, MiB) against step time (y, ms), one labelled point per strategy.

The Pareto front is drawn as a line through its points, the budget as a vertical line, and
the recommended strategy (the fastest measured one within the budget) is ringed. The x axis
spans the measured points only: a budget far beyond them is marked at the edge with an
arrow instead of stretching the axis until the points crowd together. The y axis is always
logarithmic, so equal time ratios are equal distances whatever the points (an emulated
precision 10x slower does not squash the rest), and the right-hand axis reads the ratio to
the baseline (``fp32/none``). The legend sits under the axes, where it covers no point.
Labels are placed greedily: each tries offsets around its point, nearest first, and takes
the first whose box overlaps no label, point or axes edge already there (a thin leader
line joins a label moved far from its point). Trade-off: greedy placement is simple and
deterministic but can fail on very crowded plots; it then uses the least-overlapping spot.

Example:
    >>> from memfit.records import BenchPoint
    >>> pts = [BenchPoint("fp32/none", "fp32", "none", peak_bytes=2**20, step_seconds=0.01,
    ...                   on_front=True)]
    >>> import tempfile, os
    >>> path = plot_bench(pts, os.path.join(tempfile.mkdtemp(), "bench.png"))
    >>> path.name
    'bench.png'
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfit.benchmarking.pareto import fastest_within
from memfit.budget import format_bytes
from memfit.records import BenchPoint

__all__ = ["bench_figure", "plot_bench"]

_COLORS = {"fp32": "#1f77b4", "bf16": "#d62728", "fp16": "#2ca02c"}
_MIB = 2**20


def _offsets() -> list[tuple[float, float]]:
    """Candidate label offsets in points: rings of growing radius, right and up first."""
    out: list[tuple[float, float]] = []
    for r in (8, 16, 26, 38, 52, 68):
        for dx, dy in ((1, 0.4), (1, -1), (-1, 0.4), (-1, -1), (0, 1.4), (0, -1.8), (1, 1.4), (-1, 1.4)):
            out.append((dx * r, dy * r))
    return out


def _area(a: Any, b: Any) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return max(w, 0.0) * max(h, 0.0)


def _place_labels(
    fig: Any, ax: Any, xs: list[float], ys: list[float], labels: list[str], obstacles: list[Any]
) -> None:
    from matplotlib.transforms import Bbox

    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    marks = [
        Bbox.from_extents(*(ax.transData.transform((x, y)) - 5), *(ax.transData.transform((x, y)) + 5))
        for x, y in zip(xs, ys, strict=True)
    ]
    placed: list[Any] = list(obstacles)
    scale = fig.dpi / 72.0
    order = sorted(range(len(xs)), key=lambda i: (xs[i], ys[i]))
    for i in order:
        best: tuple[float, Any] | None = None
        for dx, dy in _offsets():
            text = ax.annotate(
                labels[i],
                (xs[i], ys[i]),
                xytext=(dx, dy),
                textcoords="offset points",
                fontsize=8,
                ha="left" if dx > 0 else ("right" if dx < 0 else "center"),
                va="center",
                arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.6} if abs(dx) + abs(dy) > 30 else None,
            )
            box = text.get_window_extent(renderer).expanded(1.05, 1.15)
            outside = max(0.0, frame.x0 - box.x0) + max(0.0, box.x1 - frame.x1)
            outside += max(0.0, frame.y0 - box.y0) + max(0.0, box.y1 - frame.y1)
            cost = (
                sum(_area(box, b) for b in placed)
                + sum(_area(box, m) for j, m in enumerate(marks) if j != i)
                + outside * box.height * 10
                + (abs(dx) + abs(dy)) * scale * 0.01
            )
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, text)
            else:
                text.remove()
            if cost < (abs(dx) + abs(dy)) * scale * 0.01 + 1e-9:
                break
        assert best is not None
        placed.append(best[1].get_window_extent(renderer))


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Round values between ``lo`` and ``hi`` for a log axis: the sparsest of the 1, 1-2-5 and
    1-1.5-2-3-5-7 sequences that gives at least four ticks; a range narrower than that gets
    evenly spaced round values (on so short a log axis they are nearly evenly spaced too)."""
    from matplotlib.ticker import MaxNLocator

    for mantissas in ((1.0,), (1.0, 2.0, 5.0), (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)):
        ticks = [
            m * 10.0**e
            for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
            for m in mantissas
            if lo <= m * 10.0**e <= hi
        ]
        if len(ticks) >= 4:
            return ticks
    return [float(v) for v in MaxNLocator(nbins=6).tick_values(lo, hi) if lo <= v <= hi]


def _plain(value: float, _: Any = None) -> str:
    return f"{float(f'{value:.3g}'):g}"


def _baseline(points: Sequence[BenchPoint]) -> BenchPoint | None:
    """The point the time ratios are relative to: the one named as every point's baseline."""
    names = {p.baseline for p in points if p.baseline} or {"fp32/none"}
    return next((p for p in points if p.strategy in names and p.step_seconds > 0), None)


def _time_axis(ax: Any, ys: list[float], points: Sequence[BenchPoint]) -> None:
    """A log y axis over ``ys`` (ms) with round ticks, and the ratio to the baseline on the right."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    lo, hi = min(ys) / 1.3, max(ys) * 1.3
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    ax.set_ylabel("step time, median (ms, log scale)")
    ax.yaxis.set_major_locator(FixedLocator(_log_ticks(lo, hi)))
    ax.yaxis.set_major_formatter(FuncFormatter(_plain))
    ax.yaxis.set_minor_locator(NullLocator())
    base = _baseline(points)
    if base is None:
        return
    ref = base.step_seconds * 1e3
    right = ax.secondary_yaxis("right", functions=(lambda v: v / ref, lambda r: r * ref))
    right.set_ylabel(f"step time relative to {base.strategy}")
    right.yaxis.set_major_locator(FixedLocator(_log_ticks(lo / ref, hi / ref)))
    right.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{_plain(v)}x"))
    right.yaxis.set_minor_locator(NullLocator())


def bench_figure(points: Sequence[BenchPoint], budget_bytes: int | None = None, title: str = "") -> Any:
    """Build the figure (a matplotlib ``Figure``, Agg backend) without saving it.

    Args:
        points: what :func:`memfit.bench` returned (failed points are left out).
        budget_bytes: drawn as a dashed vertical line when given (an arrow at the edge when
            it is far from the measured points); the strategy it recommends is ringed.
        title: the device, appended to the plot's title ("... on cpu (AMD EPYC (2 cores))").

    Returns:
        The figure; the caller closes it (``matplotlib.pyplot.close(fig)``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import Bbox

    ok = [p for p in points if p.ok]
    fig, ax = plt.subplots(figsize=(10, 6.5), dpi=110)
    xs = [p.peak_bytes / _MIB for p in ok]
    ys = [p.step_seconds * 1e3 for p in ok]
    for prec, color in _COLORS.items():
        sel = [i for i, p in enumerate(ok) if p.precision == prec]
        if sel:
            ax.scatter([xs[i] for i in sel], [ys[i] for i in sel], s=36, color=color, label=prec, zorder=3)
    other = [i for i, p in enumerate(ok) if p.precision not in _COLORS]
    if other:
        ax.scatter([xs[i] for i in other], [ys[i] for i in other], s=36, color="0.3", label="other", zorder=3)
    front = sorted((x, y) for x, y, p in zip(xs, ys, ok, strict=True) if p.on_front)
    if front:
        ax.plot(
            [f[0] for f in front],
            [f[1] for f in front],
            "-",
            color="0.25",
            lw=1.4,
            label="Pareto front",
            zorder=2,
        )
    best = fastest_within(ok, budget_bytes) if budget_bytes is not None else None
    if best is not None:
        ax.scatter(
            [best.peak_bytes / _MIB],
            [best.step_seconds * 1e3],
            s=200,
            facecolors="none",
            edgecolors="black",
            linewidths=1.6,
            label=f"recommended: {best.strategy}",
            zorder=4,
        )
    ax.set_xlabel("peak memory per training step (MiB)")
    ax.set_ylabel("step time, median (ms)")
    ax.set_title("memfit bench: peak memory against step time" + (f" on {title}" if title else ""))
    ax.grid(True, alpha=0.3)
    if xs:
        # the axis spans the measured points; the budget only joins it when it is near.
        lo_x, hi_x = min(xs), max(xs)
        pad_x = (hi_x - lo_x) * 0.18 or max(hi_x * 0.1, 1e-3)
        left, right = lo_x - pad_x, hi_x + pad_x
        if budget_bytes is not None and left - pad_x <= budget_bytes / _MIB <= right + pad_x:
            left, right = min(left, budget_bytes / _MIB - pad_x), max(right, budget_bytes / _MIB + pad_x)
        ax.set_xlim(left, right)
        _time_axis(ax, [max(y, 1e-6) for y in ys], ok)
    edge = _draw_budget(ax, budget_bytes) if budget_bytes is not None else None
    entries = len(ax.get_legend_handles_labels()[1])
    legend = ax.legend(
        loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=min(entries, 6) or 1, fontsize=8, frameon=False
    )
    fig.tight_layout()
    obstacles = [legend.get_window_extent()] + ([edge.get_window_extent()] if edge is not None else [])
    if best is not None:
        at = ax.transData.transform((best.peak_bytes / _MIB, best.step_seconds * 1e3))
        obstacles.append(Bbox.from_extents(*(at - 9), *(at + 9)))  # the ring around the recommendation
    _place_labels(fig, ax, xs, ys, [p.strategy for p in ok], obstacles)
    return fig


def _draw_budget(ax: Any, budget_bytes: int) -> Any:
    """The budget as a dashed vertical line, or (returned) a note at the edge when it is off the axis."""
    label = f"budget {format_bytes(budget_bytes)}"
    x = budget_bytes / _MIB
    left, right = ax.get_xlim()
    if left <= x <= right:
        ax.axvline(x, color="#9467bd", ls="--", lw=1.3, label=label)
        return None
    beyond = x > right
    return ax.annotate(
        f"{label} \u2192" if beyond else f"\u2190 {label}",
        xy=(0.99 if beyond else 0.01, 0.02),
        xycoords="axes fraction",
        ha="right" if beyond else "left",
        va="bottom",
        fontsize=9,
        color="#9467bd",
    )


def plot_bench(
    points: Sequence[BenchPoint],
    path: str | Path,
    budget_bytes: int | None = None,
    title: str = "",
) -> Path:
    """Draw memory against step time for the measured points and save a PNG.

    Args:
        points: what :func:`memfit.bench` returned (failed points are left out).
        path: where to write the PNG.
        budget_bytes: drawn as a dashed vertical line when given.
        title: appended to the plot's title (e.g. the device).

    Returns:
        The path written.
    """
    import matplotlib.pyplot as plt

    fig = bench_figure(points, budget_bytes, title)
    try:
        out = Path(path)
        fig.savefig(out)
    finally:
        plt.close(fig)
    return out
