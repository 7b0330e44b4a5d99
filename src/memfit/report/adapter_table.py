"""An adapter run's step on its own rows: ``memfit estimate`` with a ``[model.lora]`` table.

A LoRA or QLoRA step's memory is mostly the frozen base, which has no gradient and no
optimizer state; the adapters are small but have both. :func:`adapter_table` puts each part
of the predicted peak on its own row (frozen base, adapter weights, their gradients and
optimizer state, activations, temporaries, the peak) with one column per way of storing the
frozen base (fp32, bf16, NF4), each with and without the chunked loss head when asked for.
The loss head's own bytes are :func:`memfit.report.memory_tables.head_table`'s.

The numbers are the step model's (:mod:`memfit.stepmodel`), as :mod:`memfit.cli.estimate`
predicts them under fake tensors; the gradient row is what is alive at the peak (a step's
peak usually comes in the forward, before any gradient exists), and the adapters' whole
gradient is said below the table.

Example:
    >>> from memfit.records import EstimateEntry
    >>> e = EstimateEntry("bf16", "full", 1000, {"params": 600, "grads": 0, "optimizer": 80,
    ...                   "activations": 200, "temporaries": 120})
    >>> print(adapter_table([("fp32 base", e)], adapter_bytes=40).splitlines()[3])
    frozen base (with buffers)             560 B
"""

from __future__ import annotations

from collections.abc import Sequence

from memfit.budget import format_bytes
from memfit.records import EstimateEntry
from memfit.report.table import text_table

__all__ = ["ADAPTER_ROWS", "adapter_table"]

#: The rows of :func:`adapter_table`, after the checkpointing mode.
ADAPTER_ROWS = (
    "frozen base (with buffers)",
    "adapter weights",
    "adapter gradients (alive at the peak)",
    "adapter optimizer state",
    "activations",
    "temporaries",
    "peak",
)


def _parts(e: EstimateEntry, adapter_bytes: int) -> list[int]:
    b = e.breakdown
    params = b.get("params", 0)
    return [
        params - min(adapter_bytes, params),
        min(adapter_bytes, params),
        b.get("grads", 0),
        b.get("optimizer", 0),
        b.get("activations", 0),
        b.get("temporaries", 0),
        e.peak_bytes,
    ]


def adapter_table(
    columns: Sequence[tuple[str, EstimateEntry]],
    adapter_bytes: int,
    device_memory: int | None = None,
    title: str = "adapter step",
) -> str:
    """One row per part of an adapter step's peak, one column per frozen-base choice.

    Args:
        columns: ``(label, entry)`` per choice, e.g. ``("nf4 base + chunked_loss", entry)``;
            ``entry.breakdown["params"]`` holds the frozen base, its buffers and the adapters.
        adapter_bytes: the adapters' weights (the trainable parameters) in bytes.
        device_memory: adds a ``fits?`` row when given.
        title: the first column's header.

    Returns:
        The text table (rows of :data:`ADAPTER_ROWS`, after a ``checkpointing`` row).

    Example:
        >>> from memfit.records import EstimateEntry
        >>> e = EstimateEntry("bf16", "full", 100, {"params": 60, "activations": 40})
        >>> print(adapter_table([("bf16 base", e)], 8, device_memory=90).splitlines()[-1])
        fits?                                  no
    """
    headers = [title, *(label for label, _ in columns)]
    rows: list[list[str]] = [["checkpointing", *(e.mode for _, e in columns)]]
    parts = [_parts(e, adapter_bytes) for _, e in columns]
    for i, name in enumerate(ADAPTER_ROWS):
        rows.append([name, *(format_bytes(p[i]) for p in parts)])
    if device_memory is not None:
        rows.append(["fits?", *("yes" if e.peak_bytes <= device_memory else "no" for _, e in columns)])
    return text_table(headers, rows)
