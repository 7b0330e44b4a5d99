"""``memfit.plan``: the cheapest plan that fits a budget (``memfit.apply`` applies it).

``plan`` measures what the budget needs, cheapest first, and stops where more cannot change
the answer; the exact solver (:mod:`memfit.planning.choose`) picks per-block modes, segments,
precision and micro-batches; the chosen plan is applied and measured once, and planned again
under a tighter budget if it is over, so what ``plan`` returns has been seen to fit. The story
of what it measures, and when under fake tensors, is docs/planning.md; the largest-batch
search (``maximize="batch_size"``) is :mod:`memfit.planning.largest_batch`.

Trade-off: planning costs a few steps, paid once before training; in return the budget
holds by measurement, not by hope, and the same model gets the same plan.

Example:
    >>> import torch, memfit
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> x = torch.randint(0, 256, (4, 16))
    >>> p = memfit.plan(model, (x, x), gpt_loss, "90%", precision="fp32")
    >>> p.predicted_peak_bytes <= p.budget_bytes
    True
    >>> memfit.apply(model, p) is model
    True
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from memfit import progress
from memfit.api_input import check_plan_inputs
from memfit.apply import apply
from memfit.budget import Budget, format_bytes
from memfit.checkpointing import checkpointed_blocks, find_blocks, set_block_modes, uncheckpoint
from memfit.devices import Room, model_device, room
from memfit.errors import ConfigError, InfeasibleBudget, is_out_of_memory
from memfit.levers.spec import missing_torchao_hint
from memfit.measuring.lever_facts import attach_lever_facts
from memfit.measuring.memory import MemoryWatch
from memfit.measuring.preserve import create_optimizer_state, preserved
from memfit.measuring.profile import Profiler
from memfit.planning.budgets import fixed_bytes, held_bytes, refuse_over_room, resolve_in_room
from memfit.planning.choose import TIE, candidate_precisions, fixed_bytes_message, plan_from_profiles
from memfit.planning.largest_batch import largest_batch
from memfit.planning.lever_sets import (
    frozen_applied,
    lever_sets,
    levers_applied,
    plan_lever_set,
    plan_with_levers,
    replan_without,
    resolve_levers,
    usable_levers,
)
from memfit.planning.notes import complete_profile, plan_notes
from memfit.planning.verify import failing_levers
from memfit.precision import Precision
from memfit.records import Plan, Profile
from memfit.step import Batch, LossFn, batch_size, training_step
from memfit.stepmodel import simulate
from memfit.vocab import CHECKPOINT_MODES, MAXIMIZE, LeverName, Maximize, PrecisionChoice, PrecisionName

__all__ = ["plan"]

#: Re-plans after a measured check found the plan over budget.
_CHECKS = 3
#: What :meth:`_Planner._measure_in_room` reads where the plan ran out of memory.
_OUT_OF_MEMORY = -1
#: Whole steps timed per precision for the time model (more come with the checkpointed rounds).
_TIMED_STEPS = 1
#: More whole steps timed where checkpointing is needed (with the heaviest block timed alone).
_MORE_TIMED_STEPS = 2


class _Planner:
    """Measures as little as the budget needs (inside ``preserved``), then chooses."""

    def __init__(
        self,
        model: nn.Module,
        batch: Batch,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer | None,
        wanted: list[PrecisionName],
        budget: Budget,
    ) -> None:
        self.model, self.batch, self.loss_fn, self.optimizer = model, batch, loss_fn, optimizer
        self.wanted, self.budget = wanted, budget
        self.measured: list[str] = []
        self.budget_bytes = 0
        self.baseline = (0, 0.0)
        self.complete = False
        """Measure every mode even where the budget needs none (a later re-plan may need them)."""
        self.levers: list[str] = []
        self.allowed: list[str] = []
        """The levers a plan may use once refusals are out (set when choosing)."""
        self.lever_base: Mapping[str, Profile] = {}
        """The profiles without levers that lever sets are planned from."""
        self.tried: list[list[str]] = []
        """Lever sets whose plans measured over the budget."""
        """Levers the plan may use (:mod:`memfit.planning.lever_sets`)."""
        self.room: Room | None = None
        """The device's room when planning began (None: unknown); each profiler reads the room
        its own steps have."""
        self.held = 0
        """Bytes of weights, buffers and optimizer state held when the room was read."""
        self.split = True
        """Micro-batches allowed (False: the largest-batch search's batch, computed at once)."""
        self.misses: list[str] = []
        """Plans measured over their prediction, with both numbers (for the notes)."""

    def _refuse_fixed(self, budget_bytes: int, estimated: int = 0) -> None:
        fixed = fixed_bytes(self.model, self.optimizer)
        if budget_bytes < fixed and not self.levers:  # levers shrink these bytes
            name = type(self.optimizer).__name__ if self.optimizer is not None else "none"
            detail = ""
            if estimated:
                budget_bytes = self.budget.resolve(estimated)
                detail = f" ({self.budget} of the fp32 peak, estimated at {format_bytes(estimated)})"
            message = fixed_bytes_message(fixed, budget_bytes, name, detail)
            raise InfeasibleBudget(message, fixed, budget_bytes)

    def resolve(self, peak: int) -> int:
        """The budget in bytes (:func:`resolve_in_room`)."""
        return resolve_in_room(self.budget, peak, self.room, self.held, model_device(self.model))

    def profiles(self) -> dict[str, Profile]:
        create_optimizer_state(self.model, self.optimizer)
        device = model_device(self.model)
        if self.budget.bytes is not None:
            refuse_over_room(self.budget.bytes, self.budget, self.room, self.held, device)
            self._refuse_fixed(self.budget.bytes)
        profilers = {
            p: Profiler(self.model, self.batch, self.loss_fn, self.optimizer, Precision(p, device=device))
            for p in self.wanted
        }
        base = profilers.get("fp32") or Profiler(
            self.model, self.batch, self.loss_fn, self.optimizer, Precision("fp32", device=device)
        )
        if self.budget.is_fraction:
            estimate = base.estimated_peak() if self.room is not None else None
            estimate = estimate if estimate is not None else base.quick_peak()
            # Note [refusing on the estimate]
            # A fractional budget is refused on the estimated peak only with a 5% margin; a
            # budget nearer than that is decided by the measured peak.
            if estimate is not None:
                self._refuse_fixed(self.budget.resolve(int(estimate * 1.05)), estimated=estimate)
        peak = base.none().peak
        self.budget_bytes = self.resolve(peak)
        self._refuse_fixed(self.budget_bytes)
        done: dict[str, Profile] = {}
        for p, prof in profilers.items():
            if not prof.memory:
                prof.none()
            prof.time(_TIMED_STEPS)
            done[p] = prof.result()
        # the fp32 step time is the baseline only when fp32 was timed (it is a candidate)
        self.baseline = (peak, done["fp32"].step_seconds if "fp32" in done else 0.0)
        if "fp32" not in profilers:
            self.measured += base.measured
        # A precision's plans are never faster than its step without checkpointing; once a
        # plan is known that fast, that precision's checkpointing modes cannot matter.
        best: float | None = None
        for p in sorted(profilers, key=lambda q: done[q].step_seconds):
            if best is not None and best <= done[p].step_seconds * (1 - TIE):
                continue
            tight = simulate(done[p], "none").peak_bytes > self.budget_bytes
            if (tight or self.complete) and profilers[p].blocks:
                profilers[p].modes([m for m in CHECKPOINT_MODES if m != "none"])
                profilers[p].time_checkpointed(_MORE_TIMED_STEPS)
                done[p] = profilers[p].result()
            try:
                found = plan_from_profiles({p: done[p]}, self.budget_bytes)
            except InfeasibleBudget:
                continue
            best = found.predicted_step_seconds if best is None else min(best, found.predicted_step_seconds)
        for prof in profilers.values():
            self.measured += prof.measured
        return {p: done[p] for p in self.wanted}

    def check(self, profiles: Mapping[str, Profile], result: Plan) -> Plan:
        """Measure the plan; while it is over budget, re-plan under the budget less the excess
        measured (never a budget invented on the way: See Note [a measured safety margin])."""
        # Note [a measured safety margin]
        # The step model assumes blocks are additive; where they are not (tensors held across
        # blocks, e.g. U-Net skips), the measured peak can exceed the prediction. That error,
        # measured, becomes a safety margin, so the returned plan was seen to fit: the re-plan
        # searches the user's budget less the largest excess measured, and every plan measured
        # over its prediction is in the notes with both numbers (a step model's miss, to
        # report). A plan that runs out of memory when measured has no excess to measure: the
        # re-plan then searches what the device's room holds now, if that is less.
        budget = result.budget_bytes
        margin, measured = 0, 0
        segments = True
        for _ in range(_CHECKS):
            with progress.phase(f"measuring the chosen plan (one tracked step at {result.precision})"):
                measured, same_loss = self._measure_in_room(result)
            if measured == _OUT_OF_MEMORY:
                margin = max(margin, budget - self._room_left(result))
            else:
                result.measured_peak_bytes = measured
                self._note_miss(result)
            if not same_loss:
                self.measured.append(
                    "a segment changed the loss (a block's output is read elsewhere): no segments"
                )
                segments = False
            elif 0 <= measured <= budget:
                return result
            elif measured > budget:
                margin = max(margin, measured - result.predicted_peak_bytes)
            try:
                result, profiles = self._tighter(profiles, result, (budget, margin), segments)
            except InfeasibleBudget as exc:
                raise _no_tighter(budget, measured, margin, exc) from None
            result.budget_bytes = budget
        # ``result`` is the tighter plan not yet measured: the message reports the last one measured
        raise InfeasibleBudget(
            f"no plan was measured under the budget of {format_bytes(budget)} after {_CHECKS} tries; the "
            f"last measured {format_bytes(max(0, measured))}: raise the budget.",
            minimum_bytes=max(0, measured),
            budget_bytes=budget,
        )

    def _note_miss(self, result: Plan) -> None:
        """A plan measured over its prediction, in the notes with both numbers."""
        over = result.measured_peak_bytes - result.predicted_peak_bytes
        if over > 0:
            modes = ", ".join(sorted(set(result.blocks.values())))
            self.misses.append(
                f"a plan ({modes}; {result.micro_batches} micro-batch(es)) "
                f"measured {result.measured_peak_bytes:,} B, over its prediction of "
                f"{result.predicted_peak_bytes:,} B by {over:,} B: the step model missed it (please report)"
            )

    def _room_left(self, result: Plan) -> int:
        """What a step may hold now: the bytes held plus the device's room, read after ``result``
        ran out of memory; refused where that is not below the plan's prediction (a re-plan
        would choose it again)."""
        r = room(model_device(self.model))
        left = held_bytes(self.model, self.optimizer) + (r.usable if r is not None else 0)
        where = f"{format_bytes(r.free)} ({r.source})" if r is not None else "unknown"
        self.measured.append(
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

    def _tighter(
        self, profiles: Mapping[str, Profile], result: Plan, budget: tuple[int, int], segments: bool
    ) -> tuple[Plan, Mapping[str, Profile]]:
        """A plan to measure next: ``result``'s levers under the budget less the measured margin,
        else the next lever set not yet measured, under the whole budget (the margin was measured
        on another set: e.g. the fused step once 4-bit state alone measured over its prediction)."""
        whole, margin = budget
        self.tried.append(sorted(result.levers))
        try:
            levers, saved = result.levers, result.lever_savings
            tighter = plan_from_profiles(
                profiles, whole - margin, *self.baseline, segments=segments, split=self.split
            )
            tighter.levers, tighter.lever_savings = levers, saved
            tighter.loss_chunk_tokens = result.loss_chunk_tokens
            return tighter, profiles
        except InfeasibleBudget as exc:
            if not self.allowed or not self.lever_base:
                raise
            first = exc
        for levers in lever_sets(self.allowed):
            if sorted(levers) in self.tried:
                continue
            try:
                return plan_lever_set(self.lever_base, levers, whole, self.baseline, segments, self.split)
            except InfeasibleBudget:
                continue
        raise first

    def _measure_in_room(self, result: Plan) -> tuple[int, bool]:
        """:meth:`_measure`, where running out of memory reads as :data:`_OUT_OF_MEMORY` rather
        than an error."""
        try:
            return self._measure(result)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            uncheckpoint(self.model)
            return _OUT_OF_MEMORY, True

    def _measure(self, result: Plan) -> tuple[int, bool]:
        """One tracked step of the applied plan; with segments, also whether the loss is unchanged."""
        prec = Precision(result.precision, device=model_device(self.model))
        rng = torch.get_rng_state()
        reference = None
        if result.segments and result.micro_batches == 1:
            uncheckpoint(self.model)
            with torch.no_grad(), prec.autocast(), frozen_applied(self.model, result.levers):
                reference = float(self.loss_fn(self.model, self.batch))
        apply(self.model, result)
        torch.set_rng_state(rng)
        started = time.perf_counter()
        losses: list[float] = []
        with levers_applied(self.model, self.optimizer, result) as opt, MemoryWatch(self.model, opt) as watch:
            step = training_step(self.model, self.batch, self.loss_fn, opt, prec, result.micro_batches)
            losses.append(step.loss)
        uncheckpoint(self.model)
        self.measured.append(f"1 tracked step of the chosen plan ({time.perf_counter() - started:.2f} s)")
        same = reference is None or abs(losses[0] - reference) <= 1e-4 * max(1.0, abs(reference))
        return watch.peak_bytes, same


def _no_tighter(budget: int, measured: int, margin: int, exc: InfeasibleBudget) -> InfeasibleBudget:
    """The refusal where no plan fits the budget less the excess measured: the user's budget,
    what was measured, and what the re-plan searched (See Note [a measured safety margin])."""
    what = (
        f"the best plan measured {format_bytes(measured)}, over its prediction"
        if measured >= 0
        else "the best plan ran out of memory when measured"
    )
    return InfeasibleBudget(
        f"no plan fits the budget of {format_bytes(budget)}: {what}, and no plan fits the budget less "
        f"{format_bytes(margin)} ({format_bytes(budget - margin)}; {str(exc).rstrip('.')}).",
        minimum_bytes=min(measured, exc.minimum_bytes + margin)
        if measured >= 0
        else exc.minimum_bytes + margin,
        budget_bytes=budget,
    )


def _room_notes(r: Room | None, profiles: Mapping[str, Profile]) -> list[str]:
    """What was estimated rather than measured, because the plain step does not fit the room."""
    out = []
    for p, prof in profiles.items():
        if prof.memory_from != "tracked":
            where = f"the device's room ({r.source})" if r is not None else "the device's room"
            out.append(
                f"{p}: the step without checkpointing ({format_bytes(prof.measured_peak_bytes)}) does not "
                f"fit {where}: every step's memory was measured on a fake-tensor twin (nothing allocated), "
                "step times from steps that fit, and the plan itself measured for real."
            )
    return out


# Note [room before the snapshot]
# The device's room is read before measuring's snapshot of the weights (on a CPU the snapshot
# takes room the training steps will have): what a step may hold is what is held now plus
# the room.


@dataclass
class _Request:
    """What a call asks for, checked before anything runs."""

    wanted: list[PrecisionName]
    levers: list[str]
    refused: dict[str, str]
    budget: Budget
    room: Room | None
    held: int


def _request(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    precision: PrecisionChoice | Sequence[PrecisionName],
    levers: str | Sequence[LeverName] | None,
    budget: int | str | Budget,
) -> _Request:
    device = model_device(model)
    wanted = candidate_precisions(precision, device)
    allowed, refused = resolve_levers(levers, device, optimizer, precision, model)
    spec = Budget.parse(budget)  # a bad budget is refused before anything runs
    # See Note [room before the snapshot]
    return _Request(wanted, allowed, refused, spec, room(device), held_bytes(model, optimizer))


def _shown(budget: int | str | Budget) -> str:
    """A budget as progress shows it: ``60%``, ``2.00 GiB``, ``device``."""
    spec = Budget.parse(budget)
    return format_bytes(spec.bytes) if spec.bytes is not None else str(spec)


def _planning(request: _Request, batch: Batch) -> str:
    """What a plan's phase of progress says: ``planning a batch of 8 for 60% (fp32, bf16)``."""
    return (
        f"planning a batch of {batch_size(batch)} for {_shown(request.budget)} ({', '.join(request.wanted)})"
    )


def _measured_profiles(planner: _Planner, profiles: Mapping[str, Profile] | None) -> dict[str, Profile]:
    """The profiles to plan from: those given, or those the planner measures (and adds to a
    ``dict`` the caller passed, for a later re-plan)."""
    if profiles is not None and all(p in profiles for p in planner.wanted):
        profs: dict[str, Profile] = {p: profiles[p] for p in planner.wanted}
        base = profs.get("fp32", next(iter(profs.values())))
        planner.baseline = (base.measured_peak_bytes, base.step_seconds)
        create_optimizer_state(planner.model, planner.optimizer)
        planner.budget_bytes = planner.resolve(base.measured_peak_bytes)
        planner.measured.append("planned from the profiles given")
        return profs
    profs = planner.profiles()
    if isinstance(profiles, dict):
        # Only profiles with every mode measured can serve a tighter budget later.
        profiles.update({p: pr for p, pr in profs.items() if complete_profile(pr)})
    return profs


def _chosen(
    planner: _Planner, profs: dict[str, Profile], request: _Request, verify: bool
) -> tuple[Plan, dict[str, Profile]]:
    """The fastest plan that fits, with the least risky levers it needs (verified if asked)."""
    allowed = request.levers
    stepped = {"chunked_loss", "frozen_bf16", "frozen_nf4"} & set(allowed)
    step = (planner.batch, planner.loss_fn) if stepped else None
    for prof in profs.values() if allowed else []:
        attach_lever_facts(prof, planner.model, planner.optimizer, find_blocks(planner.model), step)
    allowed, unusable = usable_levers(profs, allowed)
    request.refused.update(unusable)
    planner.allowed, planner.lever_base = list(allowed), profs  # for check's tighter plans
    result, used = plan_with_levers(profs, planner.budget_bytes, planner.baseline, allowed, planner.split)
    if verify and result.levers:
        failed = failing_levers(
            planner.model, planner.batch, planner.loss_fn, planner.optimizer, result, planner.measured
        )
        allowed = [n for n in allowed if n not in failed]
        planner.allowed = list(allowed)
        request.refused.update(failed)
        result, used = replan_without(profs, planner.budget_bytes, planner.baseline, allowed, failed)
    return result, used


def _plan_batch(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    budget: int | str | Budget,
    optimizer: torch.optim.Optimizer | None,
    precision: PrecisionChoice | Sequence[PrecisionName],
    *,
    check: bool = True,
    profiles: Mapping[str, Profile] | None = None,
    levers: str | Sequence[LeverName] | None = None,
    verify: bool = False,
    split: bool = True,
) -> Plan:
    """The fastest plan for ``batch`` as it is: resolve, measure, choose, check, report
    (``split``: micro-batches allowed)."""
    started = time.perf_counter()
    request = _request(model, optimizer, precision, levers, budget)
    spec = request.budget
    if spec.bytes is not None:  # refused at once, before any progress is shown
        refuse_over_room(spec.bytes, spec, request.room, request.held, model_device(model))
    before = checkpointed_blocks(model)
    try:
        uncheckpoint(model)
        with preserved(model, optimizer), progress.phase(_planning(request, batch)):
            planner = _Planner(model, batch, loss_fn, optimizer, request.wanted, request.budget)
            planner.room, planner.held = request.room, request.held
            planner.complete = isinstance(profiles, dict)  # a cache to fill for later re-plans
            planner.levers, planner.split = request.levers, split
            profs = _measured_profiles(planner, profiles)
            result, used = _chosen(planner, profs, request, verify)
            if check:
                result = planner.check(used, result)
        result.budget_bytes = planner.budget_bytes
        result.notes = (
            plan_notes(model, result, profs)
            + planner.misses
            + _room_notes(planner.room, profs)
            + [f"lever {n} not used: {w}" for n, w in request.refused.items()]
        )
        result.measured = planner.measured
        result.baseline_from = profs.get("fp32", next(iter(profs.values()))).memory_from
        result.batch_size = batch_size(batch)
        result.planning_seconds = time.perf_counter() - started
        return result
    finally:
        uncheckpoint(model)
        if before:
            set_block_modes(model, before)


def _with_missing_levers(exc: InfeasibleBudget, levers: str | Sequence[str] | None) -> InfeasibleBudget:
    """``exc``, saying which levers torchao's absence left out and the command that adds it."""
    hint = missing_torchao_hint(levers)
    if hint is None:
        return exc
    return InfeasibleBudget(f"{str(exc).rstrip('.')}; {hint}.", exc.minimum_bytes, exc.budget_bytes)


def plan(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    budget: int | str | Budget = "device",
    optimizer: torch.optim.Optimizer | None = None,
    precision: PrecisionChoice | Sequence[PrecisionName] = "auto",
    *,
    check: bool = True,
    profiles: Mapping[str, Profile] | None = None,
    maximize: Maximize | None = None,
    levers: str | Sequence[LeverName] | None = None,
    verify: bool = False,
) -> Plan:
    """The fastest plan whose step peak fits ``budget`` (per-block checkpointing and segments,
    precision, micro-batches, levers); or, with ``maximize="batch_size"``, the largest batch
    one plan fits.

    How planning measures, and what it measures only when the budget needs it, is told in
    docs/planning.md.

    Args:
        model: the model (its current checkpointing is put back afterwards).
        batch: a representative batch (its size is the batch a training step uses).
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        budget: int bytes, ``"6GiB"``, ``"500MB"``, ``"60%"`` of the fp32 no-checkpointing peak, or
            ``"device"`` (the default): what the device has room for now, less a margin
            (:class:`memfit.devices.Room`); a budget larger than the room is refused.
        optimizer: the optimizer training will use (its state and step count).
        precision: ``"auto"`` (fp32 and what the device runs natively), one precision, or a list.
        check: measure the chosen plan and re-plan under a tighter budget if it is over.
        profiles: already-measured profiles per precision (skips profiling; not with maximize);
            a ``dict`` passed here also receives the profiles this call measures, so that a
            later re-plan (after a step runs out of memory) need not profile again.
        maximize: ``"batch_size"``: the largest batch at ``batch``'s other dimensions that one
            plan fits without micro-batches (:mod:`memfit.planning.largest_batch`).
        levers: levers beyond activations the plan may use (:mod:`memfit.levers`): None
            (default: none, so numerics are unchanged), ``"all"`` (those this device, optimizer
            and precision can run) or a list of names (each must be able to run here); the plan
            uses the least risky set that fits and says what each saves.
        verify: with levers, check the chosen ones on this model (:mod:`memfit.planning.verify`)
            and plan again without any whose check fails.

    Returns:
        A :class:`memfit.Plan` (``plan.batch_size``: the batch it was made for);
        ``memfit.apply(model, plan)`` or ``memfit.prepare`` applies it. ``plan.notes`` says what
        the time model rests on, ``plan.measured`` what planning ran, ``plan.planning_seconds``
        how long it took.

    Raises:
        InfeasibleBudget: nothing fits; ``.minimum_bytes`` is the smallest possible peak.
        ConfigError: the budget cannot be read, or ``maximize`` is unknown.
        LeverRefused: a lever named in ``levers`` cannot run here (the message says why).
    """
    check_plan_inputs(model, batch, optimizer)
    if maximize is None:
        try:
            return _plan_batch(
                model, batch, loss_fn, budget, optimizer, precision,
                check=check, profiles=profiles, levers=levers, verify=verify,
            )  # fmt: skip
        except InfeasibleBudget as exc:
            raise _with_missing_levers(exc, levers) from None
    if maximize not in MAXIMIZE:
        raise ConfigError(f"maximize={maximize!r} is not one of {', '.join(MAXIMIZE)}.")
    if profiles is not None:
        raise ConfigError("maximize='batch_size' profiles each batch size itself; do not pass profiles.")
    if levers:
        raise ConfigError("maximize='batch_size' plans without levers; leave levers out or maximize out.")
    wanted = candidate_precisions(precision, model_device(model))

    def plan_at(sized: Batch, budget_bytes: int) -> Plan:
        return _plan_batch(model, sized, loss_fn, budget_bytes, optimizer, wanted, check=check, split=False)

    spec, device = Budget.parse(budget), model_device(model)
    if spec.bytes is not None:  # refused at once, before any progress is shown
        refuse_over_room(spec.bytes, spec, room(device), held_bytes(model, optimizer), device)
    with progress.phase(f"finding the largest batch that fits {_shown(spec)}"):
        return largest_batch(model, batch, loss_fn, budget, optimizer, wanted, plan_at)
