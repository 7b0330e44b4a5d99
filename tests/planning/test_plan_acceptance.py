"""Plans on real (tiny) models: the measured peak fits the budget and matches the prediction.

For each test model (built-in GPT, a CNN and a ResNet-style CNN with BatchNorm, blocks of
different sizes, a U-Net with skips across blocks, an MLP with dropout) and each budget of
50%, 65% and 80% of the fp32 no-checkpointing peak: either the plan, applied with
``memfit.apply`` and measured by ``memfit.measure``, peaks at or under the budget and
within 5% of its prediction, or
``InfeasibleBudget`` is raised and the smallest strategy, measured, is indeed over budget.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from plan_cases import CASES, Setup
from torch import nn

import memfit
from memfit.checkpointing import checkpoint, checkpointed_blocks, uncheckpoint
from memfit.planning.solver import minimum_peak
from memfit.precision import Precision
from memfit.step import training_step
from memfit.stepmodel import simulate

# The simulator's prediction must be this close to the measured peak.
PREDICTION_RTOL = 0.05
# Checkpointing recomputes the same ops: gradients agree to float32 round-off.
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-6
BUDGETS = (50, 65, 80)


@pytest.fixture(scope="module", params=list(CASES))
def setup(request: pytest.FixtureRequest) -> Setup:
    return Setup(request.param)


def _measured(s: Setup, micro_batches: int = 1, precision: str = "fp32") -> int:
    return memfit.measure(
        s.model, s.batch, s.loss_fn, s.opt, precision, steps=1, micro_batches=micro_batches
    ).peak_bytes


def _smallest_strategy_peak(s: Setup) -> int:
    """Every block fully checkpointed, one sample per micro-batch: the least memory memfit can use."""
    uncheckpoint(s.model)
    checkpoint(s.model, mode="full")
    try:
        return _measured(s, micro_batches=s.profile.batch_size)
    finally:
        uncheckpoint(s.model)


@pytest.mark.parametrize("percent", BUDGETS)
def test_plan_fits_budget_and_prediction(setup: Setup, percent: int) -> None:
    """``plan`` applies its answer with ``memfit.apply`` and measures it with ``memfit.measure``."""
    s = setup
    baseline = s.profile.measured_peak_bytes
    try:
        plan = memfit.plan(
            s.model, s.batch, s.loss_fn, f"{percent}%", s.opt, "fp32", profiles={"fp32": s.profile}
        )
    except memfit.InfeasibleBudget as exc:
        assert exc.budget_bytes == int(baseline * percent / 100)
        assert _smallest_strategy_peak(s) > exc.budget_bytes
        return
    assert plan.budget_bytes == int(baseline * percent / 100)
    assert plan.report.baseline_peak_bytes == baseline
    assert 0 < plan.measured_peak_bytes <= plan.budget_bytes
    assert plan.measured_peak_bytes == pytest.approx(plan.predicted_peak_bytes, rel=PREDICTION_RTOL)
    assert checkpointed_blocks(s.model) == {}  # planning changed nothing
    if percent == BUDGETS[1]:
        # Measured again here, outside plan(): the same bytes (MemTracker counts are exact).
        memfit.apply(s.model, plan)
        try:
            assert _measured(s, plan.micro_batches, plan.precision) == plan.measured_peak_bytes
        finally:
            uncheckpoint(s.model)


def test_simulator_predicts_mixed_modes(setup: Setup) -> None:
    """Mixed per-block modes (not only the uniform ones profiled) are predicted within 5%."""
    s = setup
    cycle = itertools.cycle(["full", "none", "selective"])
    modes = {b.name: next(cycle) for b in s.profile.blocks}
    memfit.apply(s.model, memfit.Plan(blocks=modes))
    try:
        measured = _measured(s)
    finally:
        uncheckpoint(s.model)
    assert simulate(s.profile, modes).peak_bytes == pytest.approx(measured, rel=PREDICTION_RTOL)


def _grads(model: nn.Module, s: Setup, micro_batches: int, seed: int = 7) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    training_step(model, s.batch, s.loss_fn, None, Precision("fp32"), micro_batches)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("squeeze", ["checkpointing", "micro-batches"])
def test_planned_gradients_equal_plain(setup: Setup, squeeze: str) -> None:
    """A plan that checkpoints (or also splits the batch) gives the plain model's gradients."""
    s = setup
    full = simulate(s.profile, ["full"] * len(s.profile.blocks)).peak_bytes
    budget = full if squeeze == "checkpointing" else minimum_peak(s.profile, 2, segments=False).peak_bytes
    plan = memfit.plan(
        s.model, s.batch, s.loss_fn, budget, s.opt, "fp32", profiles={"fp32": s.profile}, check=False
    )
    if squeeze == "micro-batches":
        # per-block modes fit only with micro-batches; a segment may make room without them
        assert plan.micro_batches > 1 or plan.segments
    else:
        # checkpointing fits the whole batch; micro-batches are chosen where predicted faster
        assert set(plan.blocks.values()) != {"none"} or plan.micro_batches > 1
    plain = copy.deepcopy(s.model)
    planned = memfit.apply(copy.deepcopy(s.model), plan).model
    want = _grads(plain, s, plan.micro_batches)
    got = _grads(planned, s, plan.micro_batches)
    assert want.keys() == got.keys() and want
    torch.testing.assert_close(got, want, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    batch_dependent = (nn.Dropout, nn.modules.batchnorm._BatchNorm)
    if plan.micro_batches > 1 and not any(isinstance(m, batch_dependent) for m in s.model.modules()):
        # Micro-batching keeps the effective batch: the accumulated gradients are the full batch's.
        torch.testing.assert_close(got, _grads(plain, s, 1), rtol=GRAD_RTOL, atol=GRAD_ATOL)
