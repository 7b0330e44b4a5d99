"""``memfit.plan``: the cheapest plan that fits a budget (``memfit.apply`` applies it).

One call, four steps, each reading what the one before made and nothing else:

1. resolve the request (:mod:`memfit.planning.request`): precisions, levers, blocks, the
   budget parsed once, the device's room; everything a bad argument is refused for;
2. measure what the budget needs, cheapest first (:mod:`memfit.planning.measure`; a hopeless
   percentage is refused on the estimate: See Note [refusing on the estimate]);
3. choose: the exact solver (:mod:`memfit.planning.choose`) picks per-block modes, segments,
   precision and micro-batches, with the least risky lever set that fits
   (:mod:`memfit.planning.lever_sets`);
4. check: the chosen plan applied and measured, and planned again under a tighter budget
   while it is over, at most three times (:mod:`memfit.planning.checked`;
   See Note [a measured safety margin]), so what ``plan`` returns has been seen to fit.

The plan (the decision) and its report (what planning found) are made once, at the end. The
story of what it measures, and when under fake tensors, is docs/planning.md; the
largest-batch search (``maximize="batch_size"``) is :mod:`memfit.planning.largest_batch`.

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
    >>> memfit.apply(model, p).model is model
    True
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
from torch import nn

from memfit import progress
from memfit.api_input import check_plan_inputs
from memfit.applying import made_for
from memfit.applying.chunked_loss import CHUNKED_LOSS
from memfit.applying.registry import lever, missing_torchao_hint, usable_levers
from memfit.budget import Budget, format_bytes
from memfit.checkpointing import checkpointed_blocks, set_block_modes, uncheckpoint
from memfit.devices import Room
from memfit.errors import ConfigError, InfeasibleBudget
from memfit.levers.head import head_refusal
from memfit.measuring.lever_facts import attach_lever_facts
from memfit.measuring.preserve import preserved
from memfit.measuring.speed import timing_threads, torch_threads
from memfit.planning.checked import Checked, Chosen, check
from memfit.planning.largest_batch import largest_batch
from memfit.planning.lever_sets import plan_with_levers, replan_without
from memfit.planning.longest_sequence import longest_sequence
from memfit.planning.measure import Measured, measure
from memfit.planning.notes import plan_notes
from memfit.planning.request import Request, resolve_request
from memfit.planning.verify import failing_levers
from memfit.records import Plan, PlanReport, Profile
from memfit.step import Batch, LossFn, batch_size
from memfit.vocab import MAXIMIZE, LeverName, Maximize, PrecisionChoice, PrecisionName

__all__ = ["plan"]


def _choose(request: Request, measured: Measured) -> tuple[Chosen, dict[str, str], list[str]]:
    """The fastest plan that fits with the least risky levers it needs (verified if asked), the
    levers left out and why, and what verifying ran."""
    profs, allowed = measured.profiles, list(request.levers)
    step = (request.batch, request.loss_fn) if any(lever(n).step_facts for n in allowed) else None
    # See Note [the step's forwards with the head in chunks] in memfit/measuring/lever_facts.py
    chunkable = CHUNKED_LOSS.name in allowed and head_refusal(request.model) is None
    for prof in profs.values() if allowed else []:
        chunked = chunkable and not prof.plain_fits
        with progress.phase(f"{prof.precision}: what the levers change (the loss head, frozen weights)"):
            head = measured.head.get(prof.precision)
            attach_lever_facts(
                prof, request.model, request.optimizer, request.blocks, step, allowed, chunked, head
            )
    allowed, refused = usable_levers(profs, allowed)
    result, used = plan_with_levers(profs, measured.budget_bytes, measured.baseline, allowed, request.split)
    lines: list[str] = []
    if request.verify and result.levers:
        r = request
        failed = failing_levers(r.model, r.batch, r.loss_fn, r.optimizer, result, lines)
        allowed = [n for n in allowed if n not in failed]
        refused.update(failed)
        result, used = replan_without(
            profs, measured.budget_bytes, measured.baseline, allowed, failed, request.split
        )
    return Chosen(result, used, tuple(allowed), profs), refused, lines


def _room_notes(r: Room | None, profiles: Mapping[str, Profile]) -> list[str]:
    """What was estimated rather than measured, because the plain step does not fit the room."""
    out = []
    for p, prof in profiles.items():
        if not prof.plain_fits:
            where = f"the device's room ({r.source})" if r is not None else "the device's room"
            out.append(
                f"{p}: the step without checkpointing ({format_bytes(prof.measured_peak_bytes)}) does not "
                f"fit {where}: every step's memory was measured on a fake-tensor twin (nothing allocated), "
                "step times from steps that fit, and the plan itself measured for real."
            )
    return out


def _made(
    request: Request, measured: Measured, checked: Checked, refused: Mapping[str, str], started: float
) -> Plan:
    """The plan returned: the checked decision, what it was made for, and its report, made once."""
    chosen, profs = checked.plan, measured.profiles
    base = profs.get("fp32", next(iter(profs.values())))
    report = PlanReport(
        predicted_peak_bytes=chosen.report.predicted_peak_bytes,
        predicted_step_seconds=chosen.report.predicted_step_seconds,
        baseline_peak_bytes=chosen.report.baseline_peak_bytes,
        baseline_step_seconds=chosen.report.baseline_step_seconds,
        baseline_from=base.memory_from,
        baseline_fits=base.plain_fits,
        budget_bytes=measured.budget_bytes,
        measured_peak_bytes=checked.measured_peak_bytes,
        notes=(
            plan_notes(request.model, chosen, profs)
            + list(checked.misses)
            + _room_notes(request.room, profs)
            + [f"lever {n} not used: {w}" for n, w in refused.items()]
        ),
        measured=[*measured.lines, *checked.lines],
        lever_savings=chosen.report.lever_savings,
        planning_seconds=time.perf_counter() - started,
    )
    where = made_for(request.model, request.batch, request.device)
    return replace(chosen, batch_size=batch_size(request.batch), made_for=where, report=report)


def _plan_batch(request: Request, profiles: Mapping[str, Profile] | None = None) -> Plan:
    """The fastest plan for the request's batch as it is: measure, choose, check, report."""
    started = time.perf_counter()
    model = request.model
    before = checkpointed_blocks(model)
    threads, why = timing_threads(request.device)  # See Note [timing on the free cores]
    try:
        uncheckpoint(model)
        with torch_threads(threads), preserved(model, request.optimizer), progress.phase(request.phase):
            measured = measure(request, profiles)
            chosen, refused, lines = _choose(request, measured)
            checked = check(request, chosen, measured) if request.check else Checked(chosen.plan, 0, (), ())
        measured = replace(measured, lines=(why, *measured.lines)) if why else measured
        checked = replace(checked, lines=(*lines, *checked.lines))
        return _made(request, measured, checked, {**request.refused, **refused}, started)
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
    blocks: str | Sequence[str] | None = None,
) -> Plan:
    """The fastest plan whose step peak fits ``budget`` (per-block checkpointing and segments,
    precision, micro-batches, levers); or, with ``maximize="batch_size"``, the largest batch
    one plan fits, with ``maximize="seq_len"`` the longest sequence.

    How planning measures, and what it measures only when the budget needs it, is told in
    docs/planning.md.

    Args:
        model: the model (its current checkpointing is put back afterwards).
        batch: a representative batch (its size is the batch a training step uses).
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        budget: int bytes, ``"6GiB"``, ``"500MB"``, ``"60%"`` of the fp32 no-checkpointing peak,
            ``"device"`` (the default): what the device has room for now, less a margin
            (:class:`memfit.devices.Room`), or a :class:`memfit.budget.Budget` already parsed;
            a budget larger than the room is refused.
        optimizer: the optimizer training will use (its state and step count).
        precision: ``"auto"`` (fp32 and what the device runs natively), one precision, or a list.
        check: measure the chosen plan and re-plan under a tighter budget if it is over.
        profiles: already-measured profiles per precision (skips profiling; not with maximize);
            a ``dict`` passed here also receives the profiles this call measures, so that a
            later re-plan (after a step runs out of memory) need not profile again.
        maximize: ``"batch_size"``: the largest batch at ``batch``'s other dimensions that one
            plan fits without micro-batches (:mod:`memfit.planning.largest_batch`);
            ``"seq_len"``: the longest sequence (dimension 1 of the batch's token ids) at its
            rows that one plan fits, with ``levers`` if given; ``plan.seq_len`` is the answer
            (:mod:`memfit.planning.longest_sequence`).
        levers: levers beyond activations the plan may use (:mod:`memfit.applying`): None
            (default: none, so numerics are unchanged), ``"all"`` (those this device, optimizer
            and precision can run) or a list of names (each must be able to run here); the plan
            uses the least risky set that fits and says what each saves.
        verify: with levers, check the chosen ones on this model (:mod:`memfit.planning.verify`)
            and plan again without any whose check fails.
        blocks: the blocks to plan, as :func:`memfit.checkpoint` takes them (qualified names or
            class names); default: :func:`memfit.find_blocks`'s.

    Returns:
        A :class:`memfit.Plan`: the decision, with ``plan.report`` saying what planning found
        (``.notes``: what the time model rests on; ``.measured``: what planning ran;
        ``.planning_seconds``); ``memfit.prepare`` (or ``memfit.apply``) applies it.

    Raises:
        InfeasibleBudget: nothing fits; ``.minimum_bytes`` is the smallest possible peak.
        ConfigError: the budget cannot be read, a block is unknown, or ``maximize`` is unknown.
        LeverRefused: a lever named in ``levers`` cannot run here (the message says why).
    """
    check_plan_inputs(model, batch, optimizer)
    if maximize is not None:
        _refuse_maximize(maximize, profiles, levers)
        if maximize == "seq_len":
            return _longest(model, batch, loss_fn, budget, optimizer, precision, levers, blocks)
        return _largest(model, batch, loss_fn, budget, optimizer, precision, check, blocks)
    request = resolve_request(
        model, batch, loss_fn, budget, optimizer, precision, levers=levers, blocks=blocks, check=check,
        verify=verify,
    )  # fmt: skip
    try:
        return _plan_batch(request, profiles)
    except InfeasibleBudget as exc:
        raise _with_missing_levers(exc, levers) from None


def _refuse_maximize(
    maximize: str, profiles: Mapping[str, Profile] | None, levers: str | Sequence[str] | None
) -> None:
    if maximize not in MAXIMIZE:
        raise ConfigError(f"maximize={maximize!r} is not one of {', '.join(MAXIMIZE)}.")
    if profiles is not None:
        raise ConfigError(f"maximize={maximize!r} profiles each size itself; do not pass profiles.")
    if levers and maximize == "batch_size":
        raise ConfigError("maximize='batch_size' plans without levers; leave levers out or maximize out.")


def _largest(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    budget: int | str | Budget,
    optimizer: torch.optim.Optimizer | None,
    precision: PrecisionChoice | Sequence[PrecisionName],
    check: bool,
    blocks: str | Sequence[str] | None,
) -> Plan:
    """``maximize="batch_size"``: the largest batch one plan fits (:func:`largest_batch`)."""
    request = resolve_request(model, batch, loss_fn, budget, optimizer, precision, blocks=blocks, check=check)

    def plan_at(sized: Batch, budget_bytes: int) -> Plan:
        at = Budget(bytes=budget_bytes, text=str(budget_bytes))
        return _plan_batch(replace(request, batch=sized, budget=at, split=False))

    with progress.phase(f"finding the largest batch that fits {request.shown}"):
        return largest_batch(request, plan_at)


def _longest(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    budget: int | str | Budget,
    optimizer: torch.optim.Optimizer | None,
    precision: PrecisionChoice | Sequence[PrecisionName],
    levers: str | Sequence[LeverName] | None,
    blocks: str | Sequence[str] | None,
) -> Plan:
    """``maximize="seq_len"``: the longest sequence one plan fits (:func:`longest_sequence`)."""
    request = resolve_request(
        model, batch, loss_fn, budget, optimizer, precision, levers=levers, blocks=blocks
    )

    def plan_at(sized: Batch, budget_bytes: int) -> Plan:
        at = Budget(bytes=budget_bytes, text=str(budget_bytes))
        # See Note [real steps within the budget] in memfit/planning/longest_sequence.py
        return _plan_batch(replace(request, batch=sized, budget=at, steps_within=budget_bytes))

    with progress.phase(f"finding the longest sequence that fits {request.shown}"):
        try:
            return longest_sequence(request, plan_at)
        except InfeasibleBudget as exc:
            raise _with_missing_levers(exc, levers) from None
