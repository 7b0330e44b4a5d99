"""The bench's table and its files: bench.md, bench.json, bench.csv (and bench.png).

Rows are sorted by peak memory, smallest first; strategies that failed follow with their
reason. Trade-off: the text table rounds for reading; exact bytes and every step time are
in the JSON and CSV files.

Example:
    >>> from memfit.records import BenchPoint
    >>> p = BenchPoint("fp32/none", "fp32", "none", peak_bytes=2048, step_seconds=0.01,
    ...                peak_ratio=1.0, time_ratio=1.0, recompute_fraction=1.0, on_front=True)
    >>> print(bench_table([p]).splitlines()[2])
    fp32/none  2048        2.00 KiB  1.00x      10.0     1.00x      1.00x      *
"""

from __future__ import annotations

import csv
import platform
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from memfit.benchmarking.pareto import recommendation
from memfit.budget import format_bytes
from memfit.outputs import marked_json
from memfit.records import BenchPoint
from memfit.report.table import markdown_table, text_table

__all__ = [
    "BENCH_HEADERS",
    "bench_rows",
    "bench_table",
    "default_meta",
    "failed_lines",
    "write_bench_files",
]

BENCH_HEADERS: tuple[str, ...] = (
    "strategy",
    "peak bytes",
    "peak",
    "peak/base",
    "step ms",
    "time/base",
    "recompute",
    "front",
)
_CSV_FIELDS = (
    "strategy",
    "precision",
    "checkpointing",
    "peak_bytes",
    "peak_ratio",
    "step_seconds",
    "time_ratio",
    "flops",
    "recompute_fraction",
    "on_front",
    "micro_batches",
    "baseline",
    "device",
    "tracker",
    "error",
)


def _sorted(points: Sequence[BenchPoint]) -> list[BenchPoint]:
    return sorted((p for p in points if p.ok), key=lambda p: (p.peak_bytes, p.step_seconds))


def bench_rows(points: Sequence[BenchPoint]) -> list[list[str]]:
    """Table rows of the measured points, sorted by peak bytes; ``*`` marks the front."""
    return [
        [
            p.strategy,
            str(p.peak_bytes),
            format_bytes(p.peak_bytes),
            f"{p.peak_ratio:.2f}x",
            f"{p.step_seconds * 1e3:.1f}",
            f"{p.time_ratio:.2f}x",
            f"{p.recompute_fraction:.2f}x",
            "*" if p.on_front else "",
        ]
        for p in _sorted(points)
    ]


def failed_lines(points: Sequence[BenchPoint]) -> list[str]:
    """``"name: reason"`` for every strategy that could not run."""
    return [f"{p.strategy}: {p.error}" for p in points if not p.ok]


def bench_table(points: Sequence[BenchPoint]) -> str:
    """The plain-text table (measured strategies only)."""
    return text_table(BENCH_HEADERS, bench_rows(points))


def _baseline(points: Sequence[BenchPoint]) -> str:
    return next((p.baseline for p in points if p.ok), "")


def _markdown(points: Sequence[BenchPoint], meta: dict[str, Any], advice: str) -> str:
    lines = ["# memfit bench", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += [
        "",
        f"Ratios are to `{_baseline(points)}`, measured in the same run. Peak bytes come from "
        f"{next((p.tracker for p in points), 'MemTracker')}; step time is the median of the timed steps, "
        "run interleaved across strategies. Recompute is the step's FLOPs (FlopCounterMode) over "
        "the same precision without checkpointing. `*` marks the Pareto front.",
        "",
        markdown_table(BENCH_HEADERS, bench_rows(points)),
        "",
        advice,
        "",
    ]
    failed = failed_lines(points)
    if failed:
        lines += ["Strategies that could not run:", ""] + [f"- {f}" for f in failed] + [""]
    lines += ["![memory against step time](bench.png)", ""]
    return "\n".join(lines)


def default_meta(device: str, command: str = "", description: str = "") -> dict[str, Any]:
    """Date, machine, device and command, for the files' headers."""
    meta: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} ({platform.machine()}, Python {platform.python_version()})",
        "device": f"{device} ({description})" if description else device,
    }
    if command:
        meta["command"] = command
    return meta


def write_bench_files(
    points: Sequence[BenchPoint],
    out_dir: str | Path,
    budget_bytes: int | None = None,
    meta: dict[str, Any] | None = None,
    advice: str | None = None,
) -> dict[str, Path]:
    """Write bench.md, bench.json, bench.csv and bench.png into ``out_dir`` (created if needed).

    Args:
        points: what :func:`memfit.bench` returned.
        out_dir: the directory; files of an earlier bench there are replaced.
        budget_bytes: drawn as a vertical line and answered in the recommendation.
        meta: extra header lines (date, machine, device, command, model).
        advice: the recommendation to write (``memfit bench`` passes one that knows what the
            device only emulates); default :func:`memfit.benchmarking.pareto.recommendation`.

    Returns:
        ``{"md": path, "json": path, "csv": path, "png": path}``.
    """
    from memfit.benchmarking.plot import plot_bench

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    paths = {ext: out / f"bench.{ext}" for ext in ("md", "json", "csv", "png")}
    advice = advice if advice is not None else recommendation(points, budget_bytes)
    paths["md"].write_text(_markdown(points, meta, advice), encoding="utf-8")
    payload = {
        "meta": meta,
        "budget_bytes": budget_bytes,
        "recommendation": advice,
        "points": [p.to_dict() for p in points],
    }
    paths["json"].write_text(marked_json("bench", payload), encoding="utf-8")
    with paths["csv"].open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(_CSV_FIELDS)
        for p in [*_sorted(points), *(p for p in points if not p.ok)]:
            writer.writerow([getattr(p, name) for name in _CSV_FIELDS])
    plot_bench(points, paths["png"], budget_bytes=budget_bytes, title=str(meta.get("device", "")))
    return paths
