"""The solver against exhaustive search, on random synthetic profiles (no model runs)."""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memfit.plan.simulator import block_options, block_seconds, events, simulate
from memfit.plan.solver import minimum_peak, solve
from memfit.records import BlockStats, Profile

# Same optimum: the solver's objective value equals exhaustive search's to this tolerance
# (HiGHS proves optimality to its tolerances, ~1e-7 of the normalised objective).
OBJECTIVE_RTOL = 1e-6


@st.composite
def _block(draw: st.DrawFn, i: int) -> BlockStats:
    params = draw(st.integers(0, 10_000))
    kept_none = draw(st.integers(0, 1_000_000))
    kept_sel = draw(st.integers(0, kept_none))
    kept_full = draw(st.integers(0, kept_sel))
    bwd_none = draw(st.integers(params, params + 1_000_000))
    modes = draw(st.sampled_from([("none", "selective", "full"), ("none", "full")]))
    t_none = draw(st.floats(0.001, 1.0))
    saved = {"none": kept_none, "selective": kept_sel, "full": kept_full}
    peaks = {
        "none": bwd_none,
        "selective": bwd_none + draw(st.integers(0, 500_000)),
        "full": bwd_none + draw(st.integers(0, 1_000_000)),
    }
    seconds = {
        "none": t_none,
        "selective": t_none + draw(st.floats(0.0, 1.0)),
        "full": t_none + draw(st.floats(0.0, 2.0)),
    }
    return BlockStats(
        name=f"b{i}",
        param_bytes=params,
        saved_bytes={m: saved[m] for m in modes},
        backward_peak_bytes={m: peaks[m] for m in modes},
        forward_seconds=draw(st.floats(0.0, 0.5)),
        backward_seconds={m: seconds[m] for m in modes},
    )


@st.composite
def profiles(draw: st.DrawFn, max_blocks: int = 10) -> Profile:
    n = draw(st.integers(1, max_blocks))
    blocks = [draw(_block(i)) for i in range(n)]
    params = sum(b.param_bytes for b in blocks) + draw(st.integers(0, 10_000))
    return Profile(
        precision="fp32",
        device="cpu",
        batch_size=draw(st.integers(1, 8)),
        blocks=blocks,
        outside=BlockStats(
            "outside",
            saved_bytes={"none": draw(st.integers(0, 200_000))},
            backward_peak_bytes={"none": draw(st.integers(0, 400_000))},
        ),
        param_bytes=params,
        grad_bytes=params,
        optimizer_bytes=2 * params,
        optimizer_temp_bytes=draw(st.integers(0, params)),
        step_seconds=draw(st.floats(0.0, 20.0)),
    )


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
