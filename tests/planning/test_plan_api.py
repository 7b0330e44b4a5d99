"""plan_from_profiles (pure), apply, bad input and infeasible budgets."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from conftest import tiny_gpt, token_batch

import memfit
from memfit.budget import format_bytes
from memfit.checkpointing import checkpointed_blocks
from memfit.models.gpt import gpt_loss
from memfit.planning.choose import plan_from_profiles
from memfit.planning.solver import minimum_peak
from memfit.records import BlockStats, Plan, PlanReport, Profile
from memfit.stepmodel import simulate


def _profile(precision: str = "fp32", bytes_per: int = 4, seconds: float = 1.0, blocks: int = 4) -> Profile:
    """A synthetic profile: every block keeps 1000*bytes_per bytes unless checkpointed."""
    stats = [
        BlockStats(
            f"blocks.{i}",
            param_bytes=400,
            grad_bytes=400,
            saved_bytes={"none": 1000 * bytes_per, "selective": 600 * bytes_per, "full": 100 * bytes_per},
            backward_peak_bytes={"none": 800, "selective": 900, "full": 800 + 900 * bytes_per},
            forward_seconds=seconds,
            backward_seconds={"none": 2 * seconds, "selective": 2.3 * seconds, "full": 3 * seconds},
        )
        for i in range(blocks)
    ]
    return Profile(
        precision=precision,
        device="cpu",
        batch_size=8,
        blocks=stats,
        outside=BlockStats("outside", saved_bytes={"none": 100}, backward_peak_bytes={"none": 100}),
        param_bytes=2000,
        grad_bytes=2000,
        optimizer_bytes=4000,
        optimizer_temp_bytes=500,
        optimizer="AdamW",
        step_seconds=14 * seconds,
    )


def _peak(prof: Profile, modes: str, micro: int = 1) -> int:
    return simulate(prof, [modes] * len(prof.blocks), micro).peak_bytes


def test_roomy_budget_keeps_everything() -> None:
    prof = _profile()
    plan = plan_from_profiles({"fp32": prof}, _peak(prof, "none"))
    assert set(plan.blocks.values()) == {"none"}
    assert plan.micro_batches == 1 and plan.predicted_peak_bytes == _peak(prof, "none")


def test_tighter_budgets_checkpoint_more_and_cost_more() -> None:
    prof = _profile()
    lo, hi = _peak(prof, "full"), _peak(prof, "none")
    plans = [plan_from_profiles({"fp32": prof}, int(lo + f * (hi - lo))) for f in (1.0, 0.6, 0.3, 0.0)]
    times = [p.report.predicted_step_seconds for p in plans]
    assert times == sorted(times) and times[0] < times[-1]
    for p in plans:
        assert p.predicted_peak_bytes <= p.budget_bytes
    assert set(plans[0].blocks.values()) == {"none"}
    assert list(plans[-1].blocks.values()).count("full") >= 2


def test_micro_batches_only_when_full_checkpointing_does_not_fit() -> None:
    prof = _profile()
    full = _peak(prof, "full")
    assert plan_from_profiles({"fp32": prof}, full).micro_batches == 1
    plan = plan_from_profiles({"fp32": prof}, full - 1)
    assert plan.micro_batches > 1
    assert plan.predicted_peak_bytes <= full - 1
    assert (
        plan.predicted_peak_bytes == simulate(prof, list(plan.blocks.values()), plan.micro_batches).peak_bytes
    )


def test_precision_chosen_by_time_among_those_that_fit() -> None:
    fp32 = _profile("fp32", bytes_per=4, seconds=1.0)
    slow_bf16 = _profile("bf16", bytes_per=2, seconds=20.0)  # emulated: smaller, much slower
    fast_bf16 = _profile("bf16", bytes_per=2, seconds=0.5)  # native: smaller and faster
    roomy = _peak(fp32, "none")
    assert plan_from_profiles({"fp32": fp32, "bf16": slow_bf16}, roomy).precision == "fp32"
    assert plan_from_profiles({"fp32": fp32, "bf16": fast_bf16}, roomy).precision == "bf16"
    # fp32 needs checkpointing at this budget, and the slow bf16 is still slower: fp32 + checkpointing.
    tight = _peak(fp32, "selective")
    chosen = plan_from_profiles({"fp32": fp32, "bf16": slow_bf16}, tight)
    assert chosen.precision == "fp32" and set(chosen.blocks.values()) != {"none"}
    # Only bf16 fits without micro-batching.
    only_bf16 = _peak(slow_bf16, "full")
    assert only_bf16 < _peak(fp32, "full")
    chosen = plan_from_profiles({"fp32": fp32, "bf16": slow_bf16}, only_bf16)
    assert (chosen.precision, chosen.micro_batches) == ("bf16", 1)


def test_infeasible_budget_says_what_dominates() -> None:
    prof = _profile()
    state = prof.param_bytes + prof.grad_bytes + prof.optimizer_bytes
    assert prof.optimizer_temp_bytes > 0
    with pytest.raises(memfit.InfeasibleBudget) as info:
        plan_from_profiles({"fp32": prof}, state - 1)
    # What every step holds, without the optimizer step's temporaries.
    assert f"parameters + gradients + AdamW state alone take {format_bytes(state)};" in str(info.value)
    assert info.value.minimum_bytes > info.value.budget_bytes == state - 1
    with pytest.raises(memfit.InfeasibleBudget) as info:
        plan_from_profiles({"fp32": prof}, state + prof.optimizer_temp_bytes - 1)
    assert f"AdamW state take {format_bytes(state)} and the optimizer step" in str(info.value)
    assert "alone" not in str(info.value)
    smallest = minimum_peak(prof, 8).peak_bytes
    with pytest.raises(memfit.InfeasibleBudget) as info:
        plan_from_profiles({"fp32": prof}, smallest - 1)
    assert info.value.minimum_bytes == smallest
    assert "8 micro-batch" in str(info.value) and "activations" in str(info.value)


def test_plan_json_round_trip() -> None:
    prof = _profile()
    plan = plan_from_profiles({"fp32": prof}, _peak(prof, "selective"), 123, 1.5)
    assert Plan.from_json(plan.to_json()) == plan


def test_apply_sets_modes_and_refuses_other_models() -> None:
    model = tiny_gpt(n_layer=2)
    memfit.apply(model, Plan(blocks={"blocks.0": "full", "blocks.1": "keep"}))
    assert checkpointed_blocks(model) == {"blocks.0": "full"}
    memfit.apply(model, Plan(blocks={"blocks.1": "selective"}))
    assert checkpointed_blocks(model) == {"blocks.1": "selective"}
    with pytest.raises(memfit.errors.ConfigError, match=r"'layers\.0', 'blocks\.7'"):
        memfit.apply(model, Plan(blocks={"layers.0": "full", "blocks.7": "full", "blocks.0": "keep"}))
    assert checkpointed_blocks(model) == {"blocks.1": "selective"}  # nothing changed
    with pytest.raises(memfit.errors.ConfigError, match="use one of none, selective, full"):
        memfit.apply(model, Plan(blocks={"blocks.0": "sometimes"}))


@pytest.mark.parametrize("budget", ["abc", "-1GB", "150%", 0, "0%"])
def test_bad_budgets_are_refused(budget: object) -> None:
    model = tiny_gpt(n_layer=2)
    prof = _profile()
    with pytest.raises(memfit.errors.ConfigError):
        memfit.plan(model, token_batch(2, 16), gpt_loss, budget, profiles={"fp32": prof}, precision="fp32")  # type: ignore[arg-type]


def test_bad_precision_is_refused() -> None:
    model = tiny_gpt(n_layer=2)
    with pytest.raises(memfit.errors.UnsupportedPrecision):
        memfit.plan(model, token_batch(2, 16), gpt_loss, "1GiB", precision=["fp32", "fp8"])


def test_plan_leaves_the_model_as_it_was() -> None:
    model = tiny_gpt(n_layer=2)
    memfit.checkpoint(model, blocks=["blocks.1"], mode="selective")
    opt = torch.optim.AdamW(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = memfit.plan(model, token_batch(4, 16), gpt_loss, "90%", opt, precision="fp32")
    assert checkpointed_blocks(model) == {"blocks.1": "selective"}
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert 0 < plan.measured_peak_bytes <= plan.budget_bytes


def test_a_plan_never_measured_under_budget_reports_the_last_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plan measures over its budget: the refusal names the last measured peak (the
    tighter plan that would come next was never measured, so its 0 B is not a measurement)."""
    from memfit.planning import checked

    model, batch = tiny_gpt(), token_batch()
    seen: list[int] = []

    def over(request: object, result: Plan, lines: object) -> tuple[int, bool]:
        budget = seen[0] - 1 if seen else result.budget_bytes  # the tighter plans' reports are empty
        seen.append(budget + 1 + len(seen))
        return seen[-1], True

    def tighter(request: object, chosen: object, profiles: object, result: Plan, *rest: object) -> tuple:
        return dataclasses.replace(result, report=PlanReport()), profiles

    monkeypatch.setattr(checked, "_measure_in_room", over)
    monkeypatch.setattr(checked, "_tighter", tighter)
    with pytest.raises(memfit.InfeasibleBudget) as info:
        memfit.plan(model, batch, gpt_loss, "90%", precision="fp32")
    assert len(seen) == checked.CHECKS
    assert f"the last measured {format_bytes(seen[-1])}" in str(info.value)
    assert info.value.minimum_bytes == seen[-1]


def _budget_searched(monkeypatch: pytest.MonkeyPatch, first: object) -> tuple[list[int], list[Plan]]:
    """Plan with the first measurement replaced by ``first(result)`` (the rest real), and
    record the budgets the re-plans searched."""
    from memfit.planning import checked

    searched: list[int] = []
    measured: list[Plan] = []
    real_measure, real_tighter = checked._measure_in_room, checked._tighter

    def measure(request: Any, result: Plan, lines: list[str]) -> tuple[int, bool]:
        measured.append(result)
        return first(result) if len(measured) == 1 else real_measure(request, result, lines)  # type: ignore[operator]

    def tighter(request: Any, chosen: Any, profiles: Any, result: Plan, budget: Any, *rest: Any) -> Any:
        searched.append(budget[0] - budget[1])
        return real_tighter(request, chosen, profiles, result, budget, *rest)

    monkeypatch.setattr(checked, "_measure_in_room", measure)
    monkeypatch.setattr(checked, "_tighter", tighter)
    return searched, measured


def test_a_plan_measured_over_budget_is_replanned_under_the_budget_less_the_excess_and_noted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 36: the re-plan searches the user's budget less the excess measured, and the miss
    is in the notes with both numbers."""
    model, batch = tiny_gpt(n_layer=4), token_batch(8, 16)
    excess: list[int] = []

    def over(result: Plan) -> tuple[int, bool]:
        excess.append(result.budget_bytes - result.predicted_peak_bytes + 1000)
        return result.predicted_peak_bytes + excess[0], True

    searched, measured = _budget_searched(monkeypatch, over)
    p = memfit.plan(model, batch, gpt_loss, "50%", precision="fp32")
    assert searched == [p.budget_bytes - excess[0]]  # the user's budget less the excess: nothing invented
    assert p.predicted_peak_bytes <= searched[0] and p.measured_peak_bytes <= p.budget_bytes
    first = measured[0]
    before = first.predicted_peak_bytes
    over_by = f"{before + excess[0]:,} B, over its prediction of {before:,} B"
    assert any(f"measured {over_by}" in n for n in p.notes), p.notes


def test_a_plan_that_runs_out_of_memory_when_measured_is_replanned_under_the_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from memfit.devices import Room
    from memfit.planning import checked
    from memfit.planning.budgets import held_bytes

    model, batch = tiny_gpt(n_layer=4), token_batch(32, 16)
    opt = torch.optim.AdamW(model.parameters())
    gpt_loss(model, batch).backward()  # the optimizer's state, as planning holds it
    opt.step()
    opt.zero_grad(set_to_none=True)
    predicted = memfit.plan(
        model, batch, gpt_loss, "50%", opt, precision="fp32", check=False
    ).predicted_peak_bytes
    held = held_bytes(model, opt)
    # room for 80% of what the plan's step needs beyond what is held (with Room's margin)
    room = Room(free=16 * 2**20 + int(1.1 * 0.8 * (predicted - held)) + 2, source="a test")
    searched, _ = _budget_searched(monkeypatch, lambda result: (checked.OUT_OF_MEMORY, True))
    monkeypatch.setattr(checked, "room", lambda device: room)
    p = memfit.plan(model, batch, gpt_loss, "50%", opt, precision="fp32")
    assert searched == [held + room.usable] and p.predicted_peak_bytes <= held + room.usable < predicted
    assert any("ran out of memory when measured" in m for m in p.report.measured), p.report.measured
    # where the room holds the plan's prediction, a re-plan would choose it again: refused
    _budget_searched(monkeypatch, lambda result: (checked.OUT_OF_MEMORY, True))
    monkeypatch.setattr(checked, "room", lambda device: Room(free=2**40, source="a test"))
    with pytest.raises(memfit.InfeasibleBudget, match="ran out of memory when measured although the device"):
        memfit.plan(model, batch, gpt_loss, "50%", opt, precision="fp32")
