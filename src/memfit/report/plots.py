"""PNG plots: loss curves and stacked peak-memory bars (matplotlib, imported lazily).

Trade-off: matplotlib is slow to import, so it is imported inside the functions with the
``Agg`` backend (no display needed); importing memfit stays fast.

Example:
    >>> import tempfile, os
    >>> from memfit.records import StepMetrics
    >>> d = tempfile.mkdtemp()
    >>> loss_plot(os.path.join(d, "loss.png"), {"run": [StepMetrics(step=1, loss=2.0)]})
    >>> memory_plot(os.path.join(d, "memory.png"), {"a": {"params": 10}, "b": {"params": 5}})
    >>> sorted(os.listdir(d))
    ['loss.png', 'memory.png']
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfit.records import BREAKDOWN_KEYS, StepMetrics

__all__ = ["loss_figure", "loss_plot", "memory_figure", "memory_plot", "training_plots"]

_COLORS = {
    "params": "#4c72b0",
    "grads": "#dd8452",
    "optimizer": "#55a868",
    "activations": "#c44e52",
    "temporaries": "#8172b3",
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _smooth(values: Sequence[float], width: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def _short(name: str) -> tuple[str, str]:
    """``"memfit (bf16, planned ...)"`` -> ``("memfit", "bf16, planned ...")``: a label and its details."""
    head, sep, rest = name.partition(" (")
    return (head, rest[:-1] if rest.endswith(")") else rest) if sep and head else (name, "")


def _legend_outside(ax: Any, handles: Sequence[Any], labels: Sequence[str]) -> Any:
    """The legend to the right of the axes, where it covers no curve, bar or line."""
    return ax.legend(
        handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=9
    )


def loss_plot(path: str | os.PathLike[str], runs: dict[str, Sequence[StepMetrics]], title: str = "") -> None:
    """Training loss per step of each run (raw and smoothed) and validation loss points, as a PNG
    (:func:`loss_figure`)."""
    _save(loss_figure(runs, title), path)


def _save(fig: Any, path: str | os.PathLike[str]) -> None:
    plt = _pyplot()
    try:
        fig.savefig(path)
    finally:
        plt.close(fig)


def loss_figure(runs: dict[str, Sequence[StepMetrics]], title: str = "") -> Any:
    """The figure of :func:`loss_plot` (the caller closes it).

    The legend sits beside the axes: one short entry per run (its name up to `` (``; what
    follows is printed under the plot) and one per line style (train, validation).
    """
    from matplotlib.lines import Line2D

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    handles: list[Any] = []
    labels: list[str] = []
    details: list[str] = []
    any_val = any_raw = False
    for i, (name, history) in enumerate(runs.items()):
        color = f"C{i}"
        steps = [m.step for m in history]
        losses = [m.loss for m in history]
        width = max(1, len(losses) // 20)
        if width > 1:
            any_raw = True
            ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
        (line,) = ax.plot(steps, _smooth(losses, width), color=color, linewidth=1.8)
        val = [(m.step, m.val_loss) for m in history if m.val_loss is not None]
        if val:
            any_val = True
            ax.plot(*zip(*val, strict=True), "o--", color=color, markersize=5)
        label, detail = _short(name)
        handles.append(line)
        labels.append(label)
        if detail:
            details.append(f"{label}: {detail}")
    handles.append(Line2D([], [], color="0.3", linewidth=1.8))
    labels.append("train (smoothed)" if any_raw else "train")
    if any_raw:  # the faint line under the smoothed one: every step's loss
        handles.append(Line2D([], [], color="0.3", alpha=0.25, linewidth=0.8))
        labels.append("train (each step)")
    if any_val:
        handles.append(Line2D([], [], color="0.3", ls="--", marker="o", markersize=5))
        labels.append("validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    _legend_outside(ax, handles, labels)
    if details:
        fig.text(0.01, 0.01, "\n".join(details), fontsize=8, color="0.25", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.045 * len(details), 1, 1))
    return fig


def memory_plot(
    path: str | os.PathLike[str],
    breakdowns: dict[str, dict[str, int]],
    title: str = "",
    budget_bytes: int | None = None,
) -> None:
    """Stacked bars of peak memory by part (params, grads, optimizer, activations, temporaries);
    ``budget_bytes`` is drawn as a dashed line when given. A PNG of :func:`memory_figure`."""
    _save(memory_figure(breakdowns, title, budget_bytes), path)


def memory_figure(
    breakdowns: dict[str, dict[str, int]], title: str = "", budget_bytes: int | None = None
) -> Any:
    """The figure of :func:`memory_plot` (the caller closes it).

    The legend sits beside the axes, so it covers neither the bars nor the budget line; a
    part that holds no bytes at the peak in any bar (often the gradients: freed or not yet
    made when the step peaks) is named under the legend instead of given a colour.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    names = list(breakdowns)
    mib = 1024.0 * 1024.0
    bottoms = [0.0] * len(names)
    empty = []
    for key in BREAKDOWN_KEYS:
        heights = [breakdowns[n].get(key, 0) / mib for n in names]
        if not any(heights):
            empty.append(key)
            continue
        ax.bar(names, heights, bottom=bottoms, color=_COLORS[key], label=key, width=0.55)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x, total in enumerate(bottoms):
        ax.annotate(
            f"{total:.1f} MiB",
            (x, total),
            ha="center",
            va="bottom",
            xytext=(0, 3),
            textcoords="offset points",
        )
    top = max([*bottoms, 1e-9])
    if budget_bytes:
        label = f"budget {budget_bytes / mib:.1f} MiB"
        ax.axhline(budget_bytes / mib, color="0.2", ls="--", lw=1.2, label=label)
        top = max(top, budget_bytes / mib)
    ax.set_ylabel("peak memory of one training step (MiB)")
    ax.set_ylim(0, top * 1.15)
    ax.set_title(title or "peak memory")
    handles, labels = ax.get_legend_handles_labels()
    handles, labels = handles[::-1], labels[::-1]
    if empty:
        from matplotlib.patches import Patch

        handles.append(Patch(facecolor="none", edgecolor="none"))
        labels.append(f"{', '.join(empty)}: 0 at the peak")
    _legend_outside(ax, handles, labels)
    fig.tight_layout()
    return fig


def training_plots(
    out: str | os.PathLike[str],
    history: Sequence[StepMetrics],
    breakdown: dict[str, int] | None,
    budget_bytes: int | None = None,
    title: str = "",
) -> dict[str, Path]:
    """``loss.png`` (and ``memory.png`` when a step's memory was tracked) in ``out``, as the demo draws them.

    Returns:
        ``{"loss": path, "memory": path}`` for the files written.
    """
    folder = Path(out)
    written = {"loss": folder / "loss.png"}
    loss_plot(written["loss"], {"train": history}, title=title or "training loss")
    if breakdown:
        written["memory"] = folder / "memory.png"
        title = "peak memory of one training step"
        memory_plot(written["memory"], {"this run": breakdown}, title, budget_bytes)
    return written
