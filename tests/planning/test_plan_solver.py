"""The solver against exhaustive search, on random synthetic profiles (no model runs).

Plans are tilings of the blocks by options: a block in its own mode, or a segment of
consecutive blocks checkpointed as one (where the profile's chain links allow it). The
search below enumerates every tiling and evaluates the step model's own events.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synthetic_profiles import profiles

from memfit.planning.solver import minimum_peak, solve
from memfit.records import BlockStats, Profile
from memfit.stepmodel import Option, all_options, block_options, events, option_seconds, simulate

# Same optimum: the solver's objective value equals exhaustive search's to this tolerance
# (HiGHS proves optimality to its tolerances, ~1e-7 of the normalised objective; the
# solver counts plans within 1e-6 of the fastest as ties).
OBJECTIVE_RTOL = 2e-6


def _tilings(profile: Profile, opts: list[Option]) -> Iterator[list[Option]]:
    by_first: dict[int, list[Option]] = {}
    for o in opts:
        by_first.setdefault(o.first, []).append(o)

    def rec(k: int) -> Iterator[list[Option]]:
        if k == len(profile.blocks):
            yield []
            return
        for o in by_first.get(k, []):
            for rest in rec(o.last + 1):
                yield [o, *rest]

    return rec(0)


class _Space:
    """Every tiling's peak and time, computed at once (one matrix product over all tilings)."""

    def __init__(self, profile: Profile, micro_batches: int) -> None:
        opts = all_options(profile)
        evs = events(profile, micro_batches, opts)  # the simulator's own expressions, built once
        self.plans = list(_tilings(profile, opts))
        index = {o: k for k, o in enumerate(opts)}
        x = np.zeros((len(opts), len(self.plans)))
        for t, plan in enumerate(self.plans):
            for o in plan:
                x[index[o], t] = 1.0
        coef = np.array([[e.coef.get(o, 0) for o in opts] for e in evs], dtype=np.int64)
        const = np.array([e.const for e in evs], dtype=np.int64)
        self.peaks = (const[:, None] + coef @ x.astype(np.int64)).max(axis=0)
        seconds = np.array([option_seconds(profile, o) for o in opts])
        self.times = seconds @ x

    def fastest(self, budget: int) -> float | None:
        fits = self.peaks <= budget
        return float(self.times[fits].min()) if fits.any() else None


def _exhaustive(profile: Profile, budget: int, micro_batches: int) -> tuple[float | None, int]:
    """(least time over every tiling whose simulated peak fits, least peak of all)."""
    space = _Space(profile, micro_batches)
    return space.fastest(budget), int(space.peaks.min())


def _budget(profile: Profile, frac: float, micro: int) -> int:
    lo = minimum_peak(profile, micro).peak_bytes
    hi = simulate(profile, [block_options(b)[0] for b in profile.blocks], micro).peak_bytes
    return int(lo + frac * (hi - lo)) if frac <= 1.0 else lo - 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=profiles(max_blocks=7), frac=st.floats(0.0, 1.2), micro=st.sampled_from([1, 1, 2, 3]))
def test_solver_matches_exhaustive_search(profile: Profile, frac: float, micro: int) -> None:
    budget = _budget(profile, frac, micro)
    expected, _ = _exhaustive(profile, budget, micro)
    got = solve(profile, budget, micro)
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert got.peak_bytes <= budget
    assert got.peak_bytes == simulate(profile, got.modes, micro, got.segments).peak_bytes
    assert got.block_seconds == pytest.approx(expected, rel=OBJECTIVE_RTOL, abs=1e-9)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=profiles(max_blocks=6), frac=st.floats(0.0, 1.0), tie=st.floats(0.0, 0.5))
def test_ties_go_to_the_lowest_peak(profile: Profile, frac: float, tie: float) -> None:
    """Among plans within ``tie_seconds`` of the fastest, the solver's has the least peak."""
    budget = _budget(profile, frac, 1)
    got = solve(profile, budget, tie_seconds=tie)
    assert got is not None
    space = _Space(profile, 1)
    fastest = space.fastest(budget)
    assert fastest is not None
    near = (space.peaks <= budget) & (space.times <= fastest + tie + 1e-9 * max(1.0, fastest))
    # the solver's tie band (1e-6 of the fastest) is measured from HiGHS's first answer, itself
    # proved only to its absolute gap (1e-6 of the normalised objective): OBJECTIVE_RTOL in all
    assert got.block_seconds <= fastest + tie + OBJECTIVE_RTOL * max(1.0, fastest)
    assert got.peak_bytes <= int(space.peaks[near].min())
    assert solve(profile, budget, tie_seconds=tie) == got  # the same answer again


def _block(name: str, saved: dict[str, int], bwd_peak: int = 0, full_seconds: float = 1.0) -> BlockStats:
    return BlockStats(
        name,
        saved_bytes=saved,
        forward_peak_bytes=dict(saved),
        backward_peak_bytes={m: bwd_peak for m in saved},
        backward_seconds={m: full_seconds if m == "full" else 1.0 for m in saved},
    )


def test_a_peak_one_byte_lower_at_the_same_time_wins() -> None:
    # NOTE: found by test_ties_go_to_the_lowest_peak: HiGHS's MIP tolerance (1e-6 of a row
    # scaled by ~1e6 bytes) let a plan one byte over the lowest peak through.
    three = {"none": 0, "selective": 0, "full": 0}
    blocks = [
        _block("b0", three),
        _block("b1", three),
        _block("b2", {"none": 1, "selective": 0, "full": 0}),
        _block("b3", {"none": 0, "full": 0}),
        _block("b4", {"none": 92232, "full": 0}, full_seconds=2.0),
        _block("b5", {"none": 0, "full": 0}, bwd_peak=907769),
    ]
    prof = Profile(
        precision="fp32", device="cpu", batch_size=1, blocks=blocks, outside=BlockStats("outside"),
        param_bytes=0, grad_bytes=0, optimizer_bytes=0, optimizer_temp_bytes=0,
    )  # fmt: skip
    keep = simulate(prof, "none").peak_bytes
    got = solve(prof, keep, tie_seconds=0.0)
    assert got is not None
    assert got.peak_bytes == keep - 1 and got.block_seconds == 6.0
    assert got.modes[2] in ("selective", "full")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=profiles(max_blocks=9))
def test_solver_matches_exhaustive_search_at_nine_blocks(profile: Profile) -> None:
    budget = _budget(profile, 0.5, 1)
    expected, _ = _exhaustive(profile, budget, 1)
    got = solve(profile, budget)
    assert expected is not None and got is not None
    assert got.block_seconds == pytest.approx(expected, rel=OBJECTIVE_RTOL, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(profile=profiles(max_blocks=6))
def test_minimum_peak_is_the_smallest(profile: Profile) -> None:
    _, smallest = _exhaustive(profile, 2**62, 1)
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


def test_a_tie_found_by_hypothesis_is_within_the_band_and_highs_gap() -> None:
    """The case that showed the band is taken from HiGHS's first answer: 7.00001 s for 7.0 s."""
    flat = {"none": 0, "full": 0}
    blocks = [
        BlockStats(
            f"b{k}",
            saved_bytes=dict(flat),
            forward_peak_bytes=dict(flat),
            backward_peak_bytes=dict(flat),
            backward_seconds={"none": 1.0, "full": 1.0},
        )
        for k in range(4)
    ]
    blocks.append(
        BlockStats(
            "b4",
            saved_bytes={"none": 2, "full": 0},
            forward_peak_bytes={"none": 2, "full": 0},
            backward_peak_bytes=dict(flat),
            backward_seconds={"none": 1.0, "full": 2.0},
        )
    )
    three = {"none": 0, "selective": 0, "full": 0}
    blocks.append(
        BlockStats(
            "b5",
            saved_bytes={"none": 1, "selective": 0, "full": 0},
            forward_peak_bytes={"none": 1, "selective": 0, "full": 1},
            backward_peak_bytes=three,
            backward_seconds={"none": 1.0, "selective": 1.00001, "full": 1.0},
        )
    )
    outside = BlockStats("outside", saved_bytes={"none": 0}, backward_peak_bytes={"none": 0})
    profile = Profile("fp32", "cpu", 1, blocks, outside, 0, 0, 0, 0, chain_links=[False] * 4 + [True])
    got = solve(profile, 1)
    assert got is not None and got.peak_bytes <= 1
    assert got.block_seconds <= 7.0 + OBJECTIVE_RTOL * 7.0
