"""The planner is never worse than keeping everything: per block, per plan, and in its errors."""

from __future__ import annotations

import pytest

import memfit
from memfit.planning.choose import plan_from_profiles
from memfit.planning.solver import minimum_peak, solve, useful_modes
from memfit.records import BlockStats, Profile
from memfit.stepmodel import simulate


def _block(name: str, full_saved: int = 100, full_bwd: int = 900) -> BlockStats:
    return BlockStats(
        name,
        param_bytes=400,
        grad_bytes=400,
        saved_bytes={"none": 1000, "selective": 600, "full": full_saved},
        backward_peak_bytes={"none": 800, "selective": 900, "full": full_bwd},
        forward_seconds=1.0,
        backward_seconds={"none": 2.0, "selective": 2.3, "full": 3.0},
    )


def _profile(blocks: list[BlockStats]) -> Profile:
    return Profile(
        precision="fp32",
        device="cpu",
        batch_size=4,
        blocks=blocks,
        outside=BlockStats("outside", saved_bytes={"none": 100}, backward_peak_bytes={"none": 100}),
        param_bytes=2000,
        grad_bytes=2000,
        optimizer_bytes=4000,
        optimizer_temp_bytes=500,
        optimizer="AdamW",
        step_seconds=14.0,
    )


def test_a_mode_that_holds_more_than_keeping_is_never_chosen() -> None:
    # Block 1's "full" keeps more than keeping it (its input is not otherwise kept) and its
    # recompute peaks higher: no event of the step is lower with it.
    bad = _block("b1", full_saved=1200, full_bwd=900)
    prof = _profile([_block("b0"), bad, _block("b2")])
    assert useful_modes(bad) == ["none", "selective"]
    assert useful_modes(prof.blocks[0]) == ["none", "selective", "full"]
    for budget in range(simulate(prof, ["full", "selective", "full"]).peak_bytes, 20_000, 250):
        sol = solve(prof, budget)
        if sol is not None:
            assert sol.modes[1] != "full", budget
    assert minimum_peak(prof).modes[1] != "full"


def test_keeping_everything_measured_under_budget_is_the_plan() -> None:
    # The simulator adds per-block numbers up and predicts keeping everything a little over
    # the budget; the measured baseline fits, so nothing is checkpointed.
    prof = _profile([_block("b0"), _block("b1")])
    simulated = simulate(prof, ["none", "none"]).peak_bytes
    plan = plan_from_profiles({"fp32": prof}, simulated - 10, baseline_peak_bytes=simulated - 20)
    assert set(plan.blocks.values()) == {"none"} and plan.micro_batches == 1
    assert plan.predicted_peak_bytes == simulated - 20 <= plan.budget_bytes


def test_minimum_bytes_is_never_above_keeping_everything() -> None:
    prof = _profile([_block("b0"), _block("b1")])
    best = min(minimum_peak(prof, m).peak_bytes for m in (1, 2, 4))
    with pytest.raises(memfit.InfeasibleBudget) as info:
        plan_from_profiles({"fp32": prof}, 1000)
    assert info.value.minimum_bytes == best
    # A measured keep-everything peak below every simulated plan is the minimum.
    with pytest.raises(memfit.InfeasibleBudget) as info:
        plan_from_profiles({"fp32": prof}, best - 100, baseline_peak_bytes=best - 50)
    assert info.value.minimum_bytes == best - 50 > info.value.budget_bytes
