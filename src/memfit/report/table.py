"""Plain-text and Markdown tables: the one formatter every command's output goes through.

Example:
    >>> print(text_table(["a", "bb"], [[1, "x"], [22, "yy"]]))
    a   bb
    --  --
    1   x
    22  yy
    >>> print(markdown_table(["a", "b"], [[1, 2]]))
    | a | b |
    |---|---|
    | 1 | 2 |
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["markdown_table", "mode_counts", "text_table"]


def mode_counts(modes: Iterable[str]) -> dict[str, int]:
    """How many blocks run in each mode, named for people: a block in mode ``none`` is "keep".

    Example:
        >>> mode_counts(["full", "none", "full"])
        {'full': 2, 'keep': 1}
    """
    # The vocabulary (memfit.vocab) spells an unchanged block "none"; next to "full 3" a
    # reader understands "keep 1" (keeps its activations) at once, so reports say that
    # (See Note [the old spelling keep] in memfit.vocab).
    counts: dict[str, int] = {}
    for mode in modes:
        label = "keep" if mode == "none" else mode
        counts[label] = counts.get(label, 0) + 1
    return counts


def _cells(rows: Sequence[Sequence[Any]]) -> list[list[str]]:
    return [[str(c) for c in row] for row in rows]


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns aligned with two spaces, numbers and text left-aligned, a dashed rule."""
    body = _cells(rows)
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in body]
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in _cells(rows)]
    return "\n".join(lines)
