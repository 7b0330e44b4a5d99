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

__all__ = ["loss_plot", "memory_plot", "training_plots"]

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


def loss_plot(path: str | os.PathLike[str], runs: dict[str, Sequence[StepMetrics]], title: str = "") -> None:
    """Training loss per step of each run (raw and smoothed) and validation loss points."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for i, (name, history) in enumerate(runs.items()):
        color = f"C{i}"
        steps = [m.step for m in history]
        losses = [m.loss for m in history]
        width = max(1, len(losses) // 20)
        if width > 1:
            ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, _smooth(losses, width), color=color, linewidth=1.8, label=f"{name}: train loss")
        val = [(m.step, m.val_loss) for m in history if m.val_loss is not None]
        if val:
            ax.plot(
                *zip(*val, strict=True), "o--", color=color, markersize=5, label=f"{name}: validation loss"
            )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def memory_plot(
    path: str | os.PathLike[str],
    breakdowns: dict[str, dict[str, int]],
    title: str = "",
    budget_bytes: int | None = None,
) -> None:
    """Stacked bars of peak memory by part (params, grads, optimizer, activations, temporaries);
    ``budget_bytes`` is drawn as a dashed line when given."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5), dpi=110)
    names = list(breakdowns)
    mib = 1024.0 * 1024.0
    bottoms = [0.0] * len(names)
    for key in BREAKDOWN_KEYS:
        heights = [breakdowns[n].get(key, 0) / mib for n in names]
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
    ax.legend(handles[::-1], labels[::-1], loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


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
