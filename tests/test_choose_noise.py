"""Profiles whose timings differ by noise give one plan; a difference clearly above it still counts.

See Note [plans repeat] in memfit/planning/choose.py. The profiles are built by hand: the
same counted work (FLOPs, bytes, ops) on every block, priced by a time model whose prices
are moved by up to 20% (a loaded machine's swing), with the timing spread that measured
such a swing.
"""

from __future__ import annotations

import itertools
import json

import pytest

from memfit.measuring.prices import fit_prices, timing_spread
from memfit.planning.choose import NOISE_CAP, plan_from_profiles
from memfit.planning.solver import as_fast, counted_work, solve
from memfit.records import BlockStats, Plan, Profile, Speed
from memfit.stepmodel import Option, fill_times, forward_work, simulate_options, tiling

GIGA = 10**9


def _block(i: int) -> BlockStats:
    return BlockStats(
        f"b{i}",
        saved_bytes={"none": 1000, "selective": 600, "full": 100},
        backward_peak_bytes={"none": 500, "selective": 900, "full": 1500},
        forward_peak_bytes={"none": 1000, "selective": 1000, "full": 1000},
        output_bytes=100,
        forward_flops=GIGA,
        selective_flops=GIGA // 5,
        forward_bytes=10**6,
        forward_ops=40,
        backward_flops={"none": 2 * GIGA, "selective": 2 * GIGA + GIGA // 5, "full": 3 * GIGA},
    )


def _profile(checkpoint: float, recompute: float, selective_op: float, spread: float) -> Profile:
    """Four identical blocks in one chain; the prices given, the times filled from them."""
    speed = Speed(
        flop_seconds=1e-11, byte_seconds=1e-10, op_seconds=1e-6, checkpoint_seconds=checkpoint,
        selective_op_seconds=selective_op, recompute_scale=recompute, spread=spread,
    )  # fmt: skip
    outside = BlockStats("outside", saved_bytes={"none": 0}, backward_peak_bytes={"none": 0})
    prof = Profile(
        "fp32",
        "cpu",
        1,  # one row: these plans choose checkpointing, not micro-batches
        [_block(i) for i in range(4)],
        outside,
        0,
        0,
        0,
        0,
        chain_links=[True] * 3,
        speed=speed,
    )
    fill_times(prof)
    prof.step_seconds = 1.2 * sum(b.forward_seconds + b.backward_seconds["none"] for b in prof.blocks)
    return prof


#: Each price at 0.8, 1 and 1.2 times its middle value: 27 timings of the same model.
NOISY = list(itertools.product((0.8e-3, 1e-3, 1.2e-3), (0.8, 1.0, 1.2), (1.6e-6, 2e-6, 2.4e-6)))
BUDGETS = range(2500, 4750, 250)


def _key(plan: Plan) -> str:
    return json.dumps((plan.blocks, plan.segments, plan.micro_batches))


def _plans(budget: int, spread: float) -> set[str]:
    return {_key(plan_from_profiles({"fp32": _profile(*prices, spread)}, budget)) for prices in NOISY}


@pytest.mark.parametrize("budget", BUDGETS)
def test_timings_within_their_spread_give_one_plan(budget: int) -> None:
    # prices moved by 20% around their middle: the extras they fit spread by about that much
    assert len(_plans(budget, 0.25)) == 1, _plans(budget, 0.25)


def test_without_the_spread_the_same_noise_changes_the_plan() -> None:
    # what the test above guards against: TIE alone (2% of a step) is narrower than the noise
    assert any(len(_plans(budget, 0.0)) > 1 for budget in BUDGETS)


def test_counted_work_is_the_ops_selective_dispatches_then_the_flops_recomputed() -> None:
    prof = _profile(1e-3, 1.0, 2e-6, 0.25)
    assert counted_work(prof, Option(1, 1, "full")) == (0, GIGA)
    assert counted_work(prof, Option(1, 1, "selective")) == (80, GIGA // 5)  # 2 x 40 ops in its mode
    assert counted_work(prof, Option(0, 1, "full")) == (0, 2 * GIGA)  # a segment recomputes both
    assert counted_work(prof, Option(1, 1, "none")) == (0, 0)


@pytest.mark.parametrize("budget", [3000, 3250, 3500, 4000])
def test_where_time_tells_nothing_the_least_counted_work_then_the_lowest_peak_wins(budget: int) -> None:
    prof = _profile(1e-3, 1.0, 2e-6, 1.0)
    sol = solve(prof, budget, noise=1.0, segments=False)  # noise 1: every plan that fits ties
    assert sol is not None
    found = []  # every plan by brute force, against the solver's
    for modes in itertools.product(["none", "selective", "full"], repeat=4):
        options = tiling(prof, list(modes))
        peak = simulate_options(prof, options).peak_bytes
        if peak <= budget:
            work = [counted_work(prof, o) for o in options]
            found.append((sum(w[0] for w in work), sum(w[1] for w in work), peak))
    work = [counted_work(prof, o) for o in sol.options]
    assert (sum(w[0] for w in work), sum(w[1] for w in work), sol.peak_bytes) == min(found)


def test_a_difference_clearly_above_the_noise_still_picks_the_faster_plan() -> None:
    # selective checkpointing's dispatch nearly free: a selective block's extra is far under a
    # third of a full recompute's, so however far the timings spread (1), time tells them apart
    # and the faster plan wins though its counted work (the ops it dispatches) is more
    cheap = _profile(1e-4, 1.0, 1e-9, 1.0)
    for block in cheap.blocks:  # and it recomputes no matmul
        block.selective_flops, block.backward_flops["selective"] = 0, block.backward_flops["none"]
    fill_times(cheap)
    modes = set(plan_from_profiles({"fp32": cheap}, 3750).blocks.values())
    assert "selective" in modes and "full" not in modes
    # and the same profile with that dispatch dear is planned without it
    dear = _profile(1e-4, 1.0, 1e-3, 1.0)
    assert set(plan_from_profiles({"fp32": dear}, 3750).blocks.values()) == {"full", "none"}


def test_as_fast_counts_the_noise_of_both_extras() -> None:
    assert not as_fast((1.0, 0.1), (1.1, 0.2), tie=0.02, noise=0.0)
    assert as_fast((1.0, 0.1), (1.1, 0.2), tie=0.02, noise=0.3)  # 0.1 <= 0.02 + 0.3 * 0.3
    assert not as_fast((1.0, 0.1), (1.5, 0.6), tie=0.02, noise=NOISE_CAP)  # 6x the extra


def test_the_spread_is_half_the_range_over_the_median_and_one_when_the_fit_is_clamped() -> None:
    assert timing_spread({"full": [1.0, 1.0, 1.0]}) == 0.0
    assert timing_spread({"full": [0.9, 1.0, 1.1], "selective": [1.0, 2.0, 3.0]}) == pytest.approx(0.5)
    assert timing_spread({"full": [-1.0, 0.0, 0.5]}) == 1.0
    assert timing_spread({"full": [1.0]}) == 0.0
    prof = _profile(1e-3, 1.0, 2e-6, 0.0)
    sp = prof.speed
    assert sp is not None
    modelled = sp.forward_scale * forward_work(prof, prof.blocks[0])
    whole = (sp.forward_scale + sp.backward_scale) * forward_work(prof, prof.blocks[0])
    # a recompute timed 1.1 times its modelled forward (plus the call), as ratios over none's
    # round (none at 2 s, the load's doing): fitted near it (the prior, 1, pulls by the spread)
    ratios = [(c * modelled + 1e-3) / whole for c in (1.05, 1.1, 1.15)]
    fit_prices(prof, "b0", {"none": [2.0] * 3, "full": [2.0 * (1 + r) for r in ratios]})
    assert sp.recompute_scale == pytest.approx(1.1, rel=0.01)
    assert sp.spread == pytest.approx(timing_spread({"full": ratios}))
    # timed 10 times its forward: a disturbed timing, clamped, and it tells nothing
    ten = (10 * modelled + 1e-3) / whole
    fit_prices(prof, "b0", {"none": [1.0] * 3, "full": [1 + ten] * 3})
    assert sp.recompute_scale == 4.0 and sp.spread == 1.0
