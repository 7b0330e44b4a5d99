"""The planner's last step: the chosen plan applied and measured, re-planned while it is over
(:func:`check`).

The chosen plan runs one tracked step inside :func:`memfit.applying.applied` (the same code
``memfit.prepare`` applies it with, undone afterwards). While its measured peak is over the
budget, it is planned again under the user's budget less the largest excess measured (the
same levers), else with the next lever set not yet measured; one loop of at most
:data:`CHECKS` tries. A plan measured over its prediction is named, with both numbers, in
:attr:`Checked.misses` (the plan's notes); one that runs out of memory when measured is
planned again under what the device's room holds then.

Example:
    >>> import torch
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> from memfit.planning.measure import measure
    >>> from memfit.planning.request import resolve_request
    >>> from memfit.planning.choose import plan_from_profiles
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> x = torch.randint(0, 256, (4, 16))
    >>> request = resolve_request(model, (x, x), gpt_loss, "90%", None, "fp32")
    >>> found = measure(request)
    >>> candidate = plan_from_profiles(found.profiles, found.budget_bytes, *found.baseline)
    >>> done = check(request, Chosen(candidate, found.profiles, (), found.profiles), found)
    >>> 0 < done.measured_peak_bytes <= found.budget_bytes
    True
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from memfit import progress
from memfit.applying import applied, made_for
from memfit.applying.registry import lever, lever_sets
from memfit.budget import format_bytes
from memfit.devices import room
from memfit.errors import InfeasibleBudget, is_out_of_memory
from memfit.measuring.memory import MemoryWatch
from memfit.planning.budgets import held_bytes
from memfit.planning.choose import plan_from_profiles
from memfit.planning.lever_sets import plan_lever_set
from memfit.planning.measure import Measured
from memfit.planning.request import Request
from memfit.records import Plan, Profile
from memfit.step import training_step

__all__ = ["CHECKS", "OUT_OF_MEMORY", "Checked", "Chosen", "check"]

#: Re-plans after a measured check found the plan over budget.
CHECKS = 3
#: What :func:`_measure_in_room` reads where the plan ran out of memory.
OUT_OF_MEMORY = -1


@dataclass(frozen=True)
class Chosen:
    """The plan chosen from the profiles, and what a tighter one would be chosen from."""

    plan: Plan
    """The candidate: the decision and its predictions (its report holds nothing else yet)."""
    profiles: Mapping[str, Profile]
    """The profiles it was planned from (its levers applied)."""
    levers: tuple[str, ...]
    """The levers a plan may use (refusals and failed checks out)."""
    lever_base: Mapping[str, Profile]
    """The profiles without levers that other lever sets are planned from."""


@dataclass(frozen=True)
class Checked:
    """The plan measured to fit, its measured peak and what the check ran."""

    plan: Plan
    measured_peak_bytes: int
    lines: tuple[str, ...]
    misses: tuple[str, ...] = ()
    """Plans measured over their prediction, with both numbers (for the plan's notes)."""


def check(request: Request, chosen: Chosen, measured: Measured) -> Checked:
    """Measure the chosen plan; while it is over budget, plan again under the budget less the
    excess measured (never a budget invented on the way: See Note [a measured safety margin]).

    Raises:
        InfeasibleBudget: no plan was measured under the budget (the last measured peak named).
    """
    # Note [a measured safety margin]
    # The step model assumes blocks are additive; where they are not (tensors held across
    # blocks, e.g. U-Net skips), the measured peak can exceed the prediction. That error,
    # measured, becomes a safety margin, so the returned plan was seen to fit: the re-plan
    # searches the user's budget less the largest excess measured, and every plan measured
    # over its prediction is in the notes with both numbers (a step model's miss, to
    # report). A plan that runs out of memory when measured has no excess to measure: the
    # re-plan then searches what the device's room holds now, if that is less.
    result, profiles, budget = chosen.plan, chosen.profiles, measured.budget_bytes
    margin = peak = 0
    segments = True
    lines: list[str] = []
    misses: list[str] = []
    tried: list[list[str]] = []
    where = made_for(request.model, request.batch, request.device)  # a candidate is made for this model
    for _ in range(CHECKS):
        result = replace(result, made_for=where)
        with progress.phase(f"measuring the chosen plan (one tracked step at {result.precision})"):
            peak, same_loss = _measure_in_room(request, result, lines)
        if peak == OUT_OF_MEMORY:
            margin = max(margin, budget - _room_left(request, result, lines))
        else:
            misses += _miss(result, peak)
        if not same_loss:
            lines.append("a segment changed the loss (a block's output is read elsewhere): no segments")
            segments = False
        elif 0 <= peak <= budget:
            return Checked(result, peak, tuple(lines), tuple(misses))
        elif peak > budget:
            margin = max(margin, peak - result.predicted_peak_bytes)
        tried.append(sorted(result.levers))
        try:
            limits = (budget, margin, measured.baseline)
            result, profiles = _tighter(request, chosen, profiles, result, limits, segments, tried)
        except InfeasibleBudget as exc:
            raise _no_tighter(budget, peak, margin, exc) from None
    # ``result`` is the tighter plan not yet measured: the message reports the last one measured
    raise InfeasibleBudget(
        f"no plan was measured under the budget of {format_bytes(budget)} after {CHECKS} tries; the "
        f"last measured {format_bytes(max(0, peak))}: raise the budget.",
        minimum_bytes=max(0, peak),
        budget_bytes=budget,
    )


def _miss(result: Plan, peak: int) -> list[str]:
    """A plan measured over its prediction, for the notes with both numbers (else nothing)."""
    over = peak - result.predicted_peak_bytes
    if over <= 0:
        return []
    modes = ", ".join(sorted(set(result.blocks.values()))) or "none"
    return [
        f"a plan ({modes}; {result.micro_batches} micro-batch(es)) measured {peak:,} B, over its "
        f"prediction of {result.predicted_peak_bytes:,} B by {over:,} B: the step model missed it "
        "(please report)"
    ]


def _room_left(request: Request, result: Plan, lines: list[str]) -> int:
    """What a step may hold now: the bytes held plus the device's room, read after ``result``
    ran out of memory; refused where that is not below the plan's prediction (a re-plan would
    choose it again)."""
    r = room(request.device)
    left = held_bytes(request.model, request.optimizer) + (r.usable if r is not None else 0)
    where = f"{format_bytes(r.free)} ({r.source})" if r is not None else "unknown"
    lines.append(
        f"the chosen plan (predicted {format_bytes(result.predicted_peak_bytes)}) ran out of memory "
        f"when measured; the device's room now: {where}"
    )
    if r is None or left >= result.predicted_peak_bytes:
        raise InfeasibleBudget(
            f"the chosen plan, predicted at {format_bytes(result.predicted_peak_bytes)}, ran out of "
            f"memory when measured although the device has room for {format_bytes(left)} now: free "
            "memory on the device or give a lower budget.",
            minimum_bytes=result.predicted_peak_bytes,
            budget_bytes=result.budget_bytes,
        )
    return left


def _no_tighter(budget: int, measured: int, margin: int, exc: InfeasibleBudget) -> InfeasibleBudget:
    """The refusal where no plan fits the budget less the excess measured: the user's budget,
    what was measured, and what the re-plan searched (See Note [a measured safety margin])."""
    what = (
        f"the best plan measured {format_bytes(measured)}, over its prediction"
        if measured >= 0
        else "the best plan ran out of memory when measured"
    )
    least = exc.minimum_bytes + margin
    return InfeasibleBudget(
        f"no plan fits the budget of {format_bytes(budget)}: {what}, and no plan fits the budget less "
        f"{format_bytes(margin)} ({format_bytes(budget - margin)}; {str(exc).rstrip('.')}).",
        minimum_bytes=min(measured, least) if measured >= 0 else least,
        budget_bytes=budget,
    )


def _tighter(
    request: Request,
    chosen: Chosen,
    profiles: Mapping[str, Profile],
    result: Plan,
    budget: tuple[int, int, tuple[int, float]],
    segments: bool,
    tried: list[list[str]],
) -> tuple[Plan, Mapping[str, Profile]]:
    """A plan to measure next: ``result``'s levers under the budget less the measured margin,
    else the next lever set not yet measured, under the whole budget (the margin was measured
    on another set: e.g. the fused step once 4-bit state alone measured over its prediction)."""
    whole, margin, baseline = budget
    try:
        tighter = plan_from_profiles(
            profiles, whole - margin, *baseline, segments=segments, split=request.split
        )
        report = replace(tighter.report, lever_savings=result.report.lever_savings)
        same = replace(tighter, levers=result.levers, lever_settings=result.lever_settings, report=report)
        return same, profiles
    except InfeasibleBudget as exc:
        if not chosen.levers or not chosen.lever_base:
            raise
        first = exc
    for levers in lever_sets(chosen.levers):
        if sorted(levers) in tried:
            continue
        try:
            return plan_lever_set(chosen.lever_base, levers, whole, baseline, segments, request.split)
        except InfeasibleBudget:
            continue
    raise first


def _measure_in_room(request: Request, result: Plan, lines: list[str]) -> tuple[int, bool]:
    """:func:`_measure`, where running out of memory reads as :data:`OUT_OF_MEMORY` rather than
    an error."""
    try:
        return _measure(request, result, lines)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        return OUT_OF_MEMORY, True


def _reference(request: Request, result: Plan) -> float | None:
    """With segments (one micro-batch), the loss without checkpointing, with the plan's levers
    that act on the model alone (the frozen weights as the step will have them)."""
    if not result.segments or result.micro_batches != 1:
        return None
    alone = [n for n in result.levers if not lever(n).needs_optimizer]
    settings = {n: s for n, s in result.lever_settings.items() if n in alone}
    plain = Plan(blocks={}, precision=result.precision, levers=alone, lever_settings=settings)
    with applied(request.model, plain) as done, torch.no_grad(), done.precision.autocast():
        return float(request.loss_fn(request.model, request.batch))


def _measure(request: Request, result: Plan, lines: list[str]) -> tuple[int, bool]:
    """One tracked step of the applied plan; with segments, also whether the loss is unchanged."""
    rng = torch.get_rng_state()
    reference = _reference(request, result)
    torch.set_rng_state(rng)
    started = time.perf_counter()
    with (
        applied(request.model, result, request.optimizer) as done,
        MemoryWatch(request.model, done.optimizer) as watch,
    ):
        step = training_step(
                request.model, request.batch, request.loss_fn, done.optimizer, done.precision,
                result.micro_batches,
            )  # fmt: skip
    lines.append(f"1 tracked step of the chosen plan ({time.perf_counter() - started:.2f} s)")
    same = reference is None or abs(step.loss - reference) <= 1e-4 * max(1.0, abs(reference))
    return watch.peak_bytes, same
