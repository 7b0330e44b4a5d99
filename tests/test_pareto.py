"""The Pareto front and the budget recommendation, on synthetic points."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.benchmarking.pareto import fastest_within, mark_front, pareto_front, recommendation
from memfit.records import BenchPoint


def _point(name: str, peak: int, seconds: float, error: str = "") -> BenchPoint:
    return BenchPoint(
        name,
        name.split("/")[0],
        name.split("/")[-1],
        peak_bytes=peak,
        step_seconds=seconds,
        peak_ratio=peak / 1000,
        time_ratio=seconds,
        baseline="fp32/none",
        error=error,
    )


def test_empty_and_single_point() -> None:
    assert pareto_front([]) == []
    assert pareto_front([(5, 1.0)]) == [True]


def test_all_equal_points_are_all_on_the_front() -> None:
    assert pareto_front([(3, 2.0)] * 4) == [True, True, True, True]


def test_ties_on_one_axis_keep_only_the_better_on_the_other() -> None:
    # same memory: only the faster; same time: only the smaller
    assert pareto_front([(10, 2.0), (10, 1.0)]) == [False, True]
    assert pareto_front([(10, 1.0), (8, 1.0)]) == [False, True]


def test_mixed_points() -> None:
    costs = [(100, 1.0), (50, 2.0), (60, 3.0), (20, 5.0), (100, 1.0), (20, 6.0), (120, 0.5)]
    assert pareto_front(costs) == [True, True, False, True, True, False, True]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=12))
def test_front_is_exactly_the_non_dominated_set(costs: list[tuple[int, int]]) -> None:
    flags = pareto_front([(float(m), float(t)) for m, t in costs])
    front = [c for c, f in zip(costs, flags, strict=True) if f]
    for a in front:  # no front point dominates another
        assert not any(b[0] <= a[0] and b[1] <= a[1] and b != a for b in front)
    for c, f in zip(costs, flags, strict=True):  # every other point is dominated by a front point
        if not f:
            assert any(b[0] <= c[0] and b[1] <= c[1] and b != c for b in front)


def test_mark_front_ignores_failed_points() -> None:
    pts = [_point("fp32/none", 100, 1.0), _point("fp16/none", 0, 0.0, error="cannot run fp16")]
    mark_front(pts)
    assert [p.on_front for p in pts] == [True, False]


def test_recommendation_for_a_budget_that_fits() -> None:
    pts = [_point("fp32/none", 1000, 1.0), _point("fp32/full", 500, 1.3), _point("bf16/full", 300, 2.0)]
    line = recommendation(pts, 600)
    assert line.startswith("for a budget of")
    assert "the fastest measured strategy that fits is fp32/full" in line
    assert fastest_within(pts, 600) is pts[1]
    assert fastest_within(pts, 1000) is pts[0]


def test_recommendation_when_nothing_fits_gives_the_smallest_peak() -> None:
    pts = [_point("fp32/none", 1000, 1.0), _point("bf16/full", 300, 2.0), _point("x/y", 0, 0, error="e")]
    line = recommendation(pts, 100)
    assert "no measured strategy fits" in line
    assert "300 bytes" in line and "bf16/full" in line
    assert fastest_within(pts, 100) is None


def test_recommendation_without_budget_and_without_points() -> None:
    pts = [_point("fp32/none", 1000, 1.0), _point("bf16/full", 300, 2.0)]
    line = recommendation(pts, None)
    assert "fastest measured: fp32/none" in line and "smallest: bf16/full" in line
    assert "could be measured" in recommendation([_point("a/b", 0, 0, error="e")], 10)


@pytest.mark.parametrize("budget", [300, 299])
def test_budget_boundary_is_inclusive(budget: int) -> None:
    best = fastest_within([_point("bf16/full", 300, 2.0)], budget)
    assert (best is not None) == (budget >= 300)
