"""Micro-batches are priced like everything else and chosen wherever predicted faster (issue 36).

See Note [what a micro-batch costs] in memfit/stepmodel/time.py and Note [micro-batches where
they are faster] in memfit/planning/choose.py. The profiles are built by hand (counted work
priced by given speeds); the prices fitted from a block timed alone are checked on given
times. No timing is measured here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.measuring.block_timing import (
    capture_block_inputs,
    fewer_rows,
    micro_batch_inputs,
    time_block_modes,
)
from memfit.measuring.prices import fit_prices, micro_label
from memfit.planning.choose import plan_from_profiles
from memfit.records import BlockStats, Profile, Speed
from memfit.stepmodel import (
    fill_times,
    micro_batch_seconds,
    predict_step_seconds,
    simulate,
    tiling,
)

GIGA = 10**9


def _block(i: int) -> BlockStats:
    return BlockStats(
        f"b{i}",
        saved_bytes={"none": 1000, "full": 100},
        backward_peak_bytes={"none": 500, "full": 1500},
        forward_peak_bytes={"none": 1000, "full": 1000},
        output_bytes=100,
        forward_flops=GIGA,
        forward_bytes=10**6,
        forward_ops=40,
        backward_flops={"none": 2 * GIGA, "full": 3 * GIGA},
    )


def _profile(split: float) -> Profile:
    """Four identical blocks, batch 8; a recompute at its forward's price; b0 in 8 micro-batches
    measured at ``split`` times its time whole."""
    speed = Speed(
        flop_seconds=1e-11, byte_seconds=1e-10, op_seconds=1e-5, checkpoint_seconds=1e-4,
        forward_scale=1.0, backward_scale=2.0, timed_block="b0", micro_batches=[8],
        micro_batch_ratios=[split],
    )  # fmt: skip
    outside = BlockStats("outside", saved_bytes={"none": 0}, backward_peak_bytes={"none": 0}, forward_ops=10)
    blocks = [_block(i) for i in range(4)]
    prof = Profile("fp32", "cpu", 8, blocks, outside, 0, 1000, 0, 0, chain_links=[True] * 3, speed=speed)
    fill_times(prof)
    prof.step_seconds = 1.2 * sum(b.forward_seconds + b.backward_seconds["none"] for b in prof.blocks)
    return prof


def test_what_micro_batches_add_grows_with_their_number_and_is_predicted() -> None:
    prof = _profile(1.7)
    added = [micro_batch_seconds(prof, tiling(prof, "none"), k) for k in (1, 2, 4, 8)]
    assert added[0] == 0.0 and 0 < added[1] < added[2] < added[3]
    # in 8 micro-batches each block costs 0.7 of its time more, as b0 measured; the outside, all
    # dispatch (ops, no FLOPs), its whole time again per micro-batch; the gradients are
    # accumulated 7 times
    sp = prof.speed
    assert sp is not None
    blocks = sum(b.forward_seconds + b.backward_seconds["none"] for b in prof.blocks)
    outside = (sp.forward_scale + sp.backward_scale) * prof.outside.forward_ops * sp.op_seconds
    assert added[3] == pytest.approx(0.7 * blocks + 7 * outside + 7 * 3 * prof.grad_bytes * sp.byte_seconds)
    assert predict_step_seconds(prof, "none", 4) == pytest.approx(
        predict_step_seconds(prof, "none") + added[2]
    )
    # a checkpointed block repeats its forward's calls in the recompute too
    assert micro_batch_seconds(prof, tiling(prof, "full"), 2) > added[1]


def test_micro_batches_are_chosen_where_faster_than_checkpointing_that_fits_whole() -> None:
    cheap = _profile(1.1)  # 8 micro-batches: 10% more than whole; a recompute: a third more
    # every block checkpointed fits the whole batch, and so do two micro-batches, nothing recomputed
    budget = max(simulate(cheap, "full").peak_bytes, simulate(cheap, "none", 2).peak_bytes)
    assert budget < simulate(cheap, "none").peak_bytes
    plan = plan_from_profiles({"fp32": cheap}, budget)
    assert plan.micro_batches > 1
    assert plan.report.predicted_step_seconds < predict_step_seconds(cheap, "full")
    # where one more micro-batch costs more than a recompute, checkpointing is the plan
    dear = _profile(8.0)
    plan = plan_from_profiles({"fp32": dear}, budget)
    assert plan.micro_batches == 1 and "full" in plan.blocks.values()


def test_the_largest_batch_search_plans_the_batch_whole() -> None:
    cheap = _profile(1.1)
    budget = simulate(cheap, "full").peak_bytes
    assert plan_from_profiles({"fp32": cheap}, budget, split=False).micro_batches == 1


def test_one_disturbed_round_does_not_move_the_prices() -> None:
    prof = _profile(1.1)
    sp = prof.speed
    assert sp is not None
    calm = {"none": [1.0] * 6, "full": [1.3] * 6}
    fit_prices(prof, "b0", calm)
    steady_scale, steady_spread = sp.recompute_scale, sp.spread
    # the same rounds with one taken while another process held the core
    disturbed = {"none": [1.0] * 5 + [1.0], "full": [1.3] * 5 + [4.0]}
    fit_prices(prof, "b0", disturbed)
    assert sp.recompute_scale == steady_scale and sp.spread == steady_spread == 0.0
    # the same ratios at twice the seconds (a slower moment for every mode alike): the same price
    fit_prices(prof, "b0", {m: [2 * t for t in ts] for m, ts in calm.items()})
    assert sp.recompute_scale == pytest.approx(steady_scale)


def test_what_micro_batches_cost_is_fitted_to_the_block_run_in_them() -> None:
    prof = _profile(1.1)
    sp = prof.speed
    assert sp is not None
    # in 2 micro-batches 1.2 times its time whole, in 8 (one row each) 2.4 times; one round of
    # the eight disturbed
    times = {"none": [1.0] * 5, micro_label(2): [1.2] * 5, micro_label(8): [2.4] * 4 + [9.0]}
    fit_prices(prof, "b0", times)
    assert sp.micro_batches == [2, 8] and sp.micro_batch_ratios == pytest.approx([1.2, 2.4])
    assert sp.spread == 0.0
    # four micro-batches: between, linear in k
    from memfit.stepmodel import micro_batch_ratio

    assert micro_batch_ratio(sp, 4) == pytest.approx(1.2 + 2 * 1.2 / 6)


def test_a_block_timed_on_one_of_several_micro_batches_prices_the_whole_batch() -> None:
    """Where the plain step does not fit, whole steps (and so the block's inputs) are one of 4
    micro-batches: the block in 2 more is 8 of the batch, and what 4 cost is inferred."""
    prof = _profile(1.1)
    sp = prof.speed
    assert sp is not None
    fit_prices(prof, "b0", {"none": [1.0] * 3, micro_label(2): [1.2] * 3}, split=4)
    phi = 0.2 / (8 - 1 - 1.2 * 3)  # 1.2 = (1 + 7 phi) / (1 + 3 phi)
    assert sp.micro_batches == [4, 8]
    assert sp.micro_batch_ratios == pytest.approx([1 + 3 * phi, 1 + 7 * phi], rel=1e-5)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.lin(x)) * mask


def test_a_block_alone_also_runs_on_fewer_rows_side_by_side() -> None:
    model = nn.Sequential(_Layer())
    x, mask = torch.randn(4, 8), torch.ones(8)
    with capture_block_inputs(model, "0") as seen:
        model[0](x, mask)
    fewer = micro_batch_inputs(seen, 4)
    assert [k for _, k in fewer] == [2, 4]  # two micro-batches of two rows, four of one
    one = fewer[1][0]
    assert one.args[0].shape == (1, 8) and one.args[1].shape == (8,)  # only the batch is cut
    times = time_block_modes(model, "0", seen, ["none", "full"], rounds=3, fewer=fewer)
    lengths = {"none": 3, "full": 3, micro_label(2): 3, micro_label(4): 3}
    assert {m: len(t) for m, t in times.items()} == lengths
    assert fewer_rows(seen, 4, 4) is None and fewer_rows(seen, 5, 1) is None
