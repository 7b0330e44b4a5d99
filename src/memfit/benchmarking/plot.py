"""The bench's picture: peak memory (x, MiB) against step time (y, ms), one labelled point per strategy.

The Pareto front is drawn as a line through its points, the budget as a vertical line, and
the recommended strategy (the fastest measured one within the budget) is ringed. The x axis
spans the measured points only: a budget far beyond them is marked at the edge with an
arrow instead of stretching the axis until the points crowd together.
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


def _minor_label(value: float, _: Any) -> str:
    """Label minor log ticks at 2x and 5x a power of ten only, in plain numbers."""
    if value <= 0:
        return ""
    mantissa = round(value / 10 ** math.floor(math.log10(value)))
    return f"{value:g}" if mantissa in (2, 5) else ""


def bench_figure(points: Sequence[BenchPoint], budget_bytes: int | None = None, title: str = "") -> Any:
    """Build the figure (a matplotlib ``Figure``, Agg backend) without saving it.

    Args:
        points: what :func:`memfit.bench` returned (failed points are left out).
        budget_bytes: drawn as a dashed vertical line when given (an arrow at the edge when
            it is far from the measured points); the strategy it recommends is ringed.
        title: appended to the plot's title (e.g. the device).

    Returns:
        The figure; the caller closes it (``matplotlib.pyplot.close(fig)``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

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
    ax.set_title("memfit bench: memory against step time" + (f" ({title})" if title else ""))
    ax.grid(True, alpha=0.3)
    if xs:
        # the axis spans the measured points; the budget only joins it when it is near.
        lo_x, hi_x = min(xs), max(xs)
        pad_x = (hi_x - lo_x) * 0.18 or max(hi_x * 0.1, 1e-3)
        left, right = lo_x - pad_x, hi_x + pad_x
        if budget_bytes is not None and left - pad_x <= budget_bytes / _MIB <= right + pad_x:
            left, right = min(left, budget_bytes / _MIB - pad_x), max(right, budget_bytes / _MIB + pad_x)
        pad_y = (max(ys) - min(ys)) * 0.18 or max(max(ys) * 0.1, 1e-3)
        ax.set_xlim(left, right)
        if min(ys) > 0 and max(ys) / min(ys) > 8:
            # emulated precisions can be 20x slower; a log axis keeps the rest apart.
            ax.set_yscale("log")
            ax.set_ylim(min(ys) / 1.25, max(ys) * 1.25)
            ax.set_ylabel("step time, median (ms, log scale)")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(_minor_label))
        else:
            ax.set_ylim(max(0.0, min(ys) - pad_y), max(ys) + pad_y)
    edge = _draw_budget(ax, budget_bytes) if budget_bytes is not None else None
    legend = ax.legend(loc="best", fontsize=8, framealpha=0.85)
    fig.tight_layout()
    obstacles = [legend.get_window_extent()] + ([edge.get_window_extent()] if edge is not None else [])
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
