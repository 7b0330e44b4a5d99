"""The solver against exhaustive search, on random synthetic profiles (no model runs)."""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synthetic_profiles import profiles

from memfit.planning.solver import minimum_peak, solve
from memfit.records import BlockStats, Profile
from memfit.stepmodel import block_options, block_seconds, events, simulate

# Same optimum: the solver's objective value equals exhaustive search's to this tolerance
# (HiGHS proves optimality to its tolerances, ~1e-7 of the normalised objective).
OBJECTIVE_RTOL = 1e-6


def _exhaustive(profile: Profile, budget: int, micro_batches: int) -> float | None:
    """Least block time over every combination of modes whose simulated peak fits."""
    options = [block_options(b) for b in profile.blocks]
    secs = [block_seconds(b) for b in profile.blocks]
    evs = events(profile, micro_batches)  # the simulator's own expressions, built once
    best = None
    for combo in itertools.product(*options):
        if max(e.value(combo) for e in evs) <= budget:
            t = sum(s[m] for s, m in zip(secs, combo, strict=True))
            best = t if best is None else min(best, t)
    return best


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=profiles(max_blocks=8), frac=st.floats(0.0, 1.2), micro=st.sampled_from([1, 1, 2, 3]))
def test_solver_matches_exhaustive_search(profile: Profile, frac: float, micro: int) -> None:
    lo = minimum_peak(profile, micro).peak_bytes
    hi = simulate(profile, [block_options(b)[0] for b in profile.blocks], micro).peak_bytes
    budget = int(lo + frac * (hi - lo)) if frac <= 1.0 else lo - 1
    expected = _exhaustive(profile, budget, micro)
    got = solve(profile, budget, micro)
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert got.peak_bytes <= budget
    assert got.peak_bytes == simulate(profile, got.modes, micro).peak_bytes
    assert got.block_seconds == pytest.approx(expected, rel=OBJECTIVE_RTOL, abs=1e-9)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=profiles(max_blocks=10))
def test_solver_matches_exhaustive_search_at_ten_blocks(profile: Profile) -> None:
    lo = minimum_peak(profile).peak_bytes
    hi = simulate(profile, [block_options(b)[0] for b in profile.blocks]).peak_bytes
    budget = (lo + hi) // 2
    expected = _exhaustive(profile, budget, 1)
    got = solve(profile, budget)
    assert expected is not None and got is not None
    assert got.block_seconds == pytest.approx(expected, rel=OBJECTIVE_RTOL, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(profile=profiles(max_blocks=6))
def test_minimum_peak_is_the_smallest(profile: Profile) -> None:
    options = [block_options(b) for b in profile.blocks]
    smallest = min(simulate(profile, list(c)).peak_bytes for c in itertools.product(*options))
    assert minimum_peak(profile).peak_bytes == smallest


def test_hundred_block_solve_time(capsys: pytest.CaptureFixture[str]) -> None:
    """Benchmark only: a 100-block, 3-option solve (the time is printed, never asserted)."""
    blocks = [
        BlockStats(
            f"b{i}",
            param_bytes=1000,
            saved_bytes={"none": 10_000 + 37 * i, "selective": 6_000 + 11 * i, "full": 1_000},
            backward_peak_bytes={"none": 9_000, "selective": 12_000, "full": 20_000 + 13 * i},
            backward_seconds={"none": 1.0 + 0.01 * i, "selective": 1.3 + 0.02 * i, "full": 2.0},
        )
        for i in range(100)
    ]
    prof = Profile("fp32", "cpu", 8, blocks, BlockStats("outside"), 100_000, 100_000, 200_000, 0)
    hi = simulate(prof, ["none"] * 100).peak_bytes
    start = time.perf_counter()
    sol = solve(prof, int(hi * 0.6))
    elapsed = time.perf_counter() - start
    assert sol is not None and sol.peak_bytes <= int(hi * 0.6)
    with capsys.disabled():
        print(f"\n100-block solve: {elapsed * 1000:.0f} ms")
