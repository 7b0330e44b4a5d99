"""The memory/time Pareto front and the budget recommendation, as pure functions.

A strategy is on the front when no other is at least as small *and* at least as fast,
and strictly better in one of the two: the front is every choice worth making, from the
fastest to the smallest. Trade-off: the front is only as good as the measurements; step
times on a noisy machine can reorder strategies whose times differ by a few percent.

Example:
    >>> pareto_front([(10, 1.0), (5, 2.0), (6, 3.0), (10, 1.0)])
    [True, True, False, True]
"""

from __future__ import annotations

from collections.abc import Sequence

from memfit.budget import format_bytes
from memfit.records import BenchPoint

__all__ = ["fastest_within", "mark_front", "pareto_front", "recommendation"]


def pareto_front(costs: Sequence[tuple[float, float]]) -> list[bool]:
    """For each ``(memory, time)`` pair, whether it is on the Pareto front (both minimised).

    Equal pairs do not dominate each other, so ties are all on the front; of two pairs
    with the same memory, only the faster one is.

    Args:
        costs: ``(memory, time)`` per candidate.

    Returns:
        One bool per pair, in the same order.
    """
    flags = []
    for i, (m, t) in enumerate(costs):
        dominated = any(
            m2 <= m and t2 <= t and (m2 < m or t2 < t) for j, (m2, t2) in enumerate(costs) if j != i
        )
        flags.append(not dominated)
    return flags


def mark_front(points: Sequence[BenchPoint]) -> None:
    """Set ``on_front`` on every point (in place); failed points are never on it."""
    ok = [p for p in points if p.ok]
    for p, flag in zip(ok, pareto_front([(p.peak_bytes, p.step_seconds) for p in ok]), strict=True):
        p.on_front = flag
    for p in points:
        if not p.ok:
            p.on_front = False


def fastest_within(points: Sequence[BenchPoint], budget_bytes: int) -> BenchPoint | None:
    """The fastest measured point whose peak fits the budget (smaller peak breaks ties), or None."""
    fits = [p for p in points if p.ok and p.peak_bytes <= budget_bytes]
    return min(fits, key=lambda p: (p.step_seconds, p.peak_bytes)) if fits else None


def _describe(p: BenchPoint) -> str:
    return (
        f"{p.strategy} (peak {format_bytes(p.peak_bytes)}, {p.peak_ratio:.2f}x; "
        f"step {p.step_seconds * 1e3:.1f} ms, {p.time_ratio:.2f}x of {p.baseline})"
    )


def recommendation(points: Sequence[BenchPoint], budget_bytes: int | None) -> str:
    """One line answering "what should I use?", for a budget or without one.

    Args:
        points: measured strategies (failed ones are ignored).
        budget_bytes: the budget, or None for the fastest and the smallest overall.

    Returns:
        For a budget: "for a budget of B, the fastest measured strategy that fits is ..."
        or, when none fits, that nothing fits and the smallest peak seen.
    """
    ok = [p for p in points if p.ok]
    if not ok:
        return "no strategy could be measured; see the reasons above."
    smallest = min(ok, key=lambda p: (p.peak_bytes, p.step_seconds))
    if budget_bytes is None:
        fastest = min(ok, key=lambda p: (p.step_seconds, p.peak_bytes))
        return (
            f"fastest measured: {_describe(fastest)}; smallest: {_describe(smallest)}; "
            "pass --budget to choose for a budget."
        )
    budget = f"{format_bytes(budget_bytes)} ({budget_bytes} bytes)"
    best = fastest_within(ok, budget_bytes)
    if best is None:
        return (
            f"for a budget of {budget}, no measured strategy fits: the smallest peak seen is "
            f"{format_bytes(smallest.peak_bytes)} ({smallest.peak_bytes} bytes, {smallest.strategy}); "
            "raise the budget, shrink the batch, or try micro-batches."
        )
    return f"for a budget of {budget}, the fastest measured strategy that fits is {_describe(best)}."
