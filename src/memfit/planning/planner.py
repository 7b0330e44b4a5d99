"""``memfit.plan``: choose the cheapest plan that fits a budget (``memfit.apply`` applies it).

``plan`` profiles the model at each allowed precision, asks the exact solver for the
fastest per-block checkpointing that fits at one micro-batch, then two, four... (the batch
is split only when even full checkpointing does not fit), keeps the precision with the
least predicted time, and finally measures the chosen plan once: if the measured peak is
over the budget (a model whose blocks are not a simple chain, such as a U-Net with skips),
it plans again under the budget less the excess, so what it returns has been seen to fit.

Trade-off: planning costs one profile per precision and one measured step per check, a few
steps in all, paid once before training; in return the budget holds by measurement, not by
hope.

Example:
    >>> import torch, memfit
    >>> from memfit.train.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> x = torch.randint(0, 256, (4, 16))
    >>> p = memfit.plan(model, (x, x), gpt_loss, "90%", precision="fp32")
    >>> p.predicted_peak_bytes <= p.budget_bytes
    True
    >>> memfit.apply(model, p) is model
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from memfit.apply import apply
from memfit.budget import Budget, format_bytes
from memfit.checkpointing import checkpointed_blocks, set_block_modes, uncheckpoint
from memfit.devices import device_facts, recommend_precision
from memfit.errors import ConfigError, InfeasibleBudget, UnsupportedPrecision
from memfit.measuring.memory import measure
from memfit.planning.solver import Solution, minimum_peak, solve
from memfit.records import Plan, Profile
from memfit.step import Batch, LossFn
from memfit.stepmodel import predict_step_seconds, simulate
from memfit.vocab import PRECISIONS

__all__ = ["candidate_precisions", "plan", "plan_from_profiles"]

#: Re-plans after a measured check found the plan over budget.
_CHECKS = 3


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def candidate_precisions(precision: str | Sequence[str], device: torch.device) -> list[str]:
    """The precisions to choose from: "auto" = fp32 and what the device runs natively."""
    if isinstance(precision, str):
        if precision == "auto":
            best = recommend_precision(device_facts(device))
            return ["fp32"] if best == "fp32" else ["fp32", best]
        chosen = [precision]
    else:
        chosen = list(precision)
    bad = [p for p in chosen if p not in PRECISIONS]
    if bad or not chosen:
        raise UnsupportedPrecision(
            f"cannot plan with precision {bad or chosen!r}; give 'auto', one of {', '.join(PRECISIONS)}, "
            "or a list of them."
        )
    return list(dict.fromkeys(chosen))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, max(1, n) + 1) if n % d == 0] or [1]


def _to_plan_modes(profile: Profile, modes: Sequence[str]) -> dict[str, str]:
    return {b.name: m for b, m in zip(profile.blocks, modes, strict=True)}


def _explain(best: tuple[str, int, Solution], profiles: Mapping[str, Profile], budget: int) -> str:
    precision, micro, sol = best
    prof = profiles[precision]
    sim = simulate(prof, sol.modes, micro)
    opt = prof.optimizer if prof.optimizer not in ("", "none") else "optimizer"
    # NOTE: "alone" means what every step holds whatever the plan: the optimizer step's
    # temporaries are not held all step (a foreach or fused step changes them), so they are
    # named apart.
    state = prof.param_bytes + prof.grad_bytes + prof.optimizer_bytes
    if state >= budget:
        return (
            f"parameters + gradients + {opt} state alone take {format_bytes(state)}; budget "
            f"{format_bytes(budget)}: use a smaller model, an optimizer with less state, or more memory."
        )
    if state + prof.optimizer_temp_bytes >= budget:
        return (
            f"parameters + gradients + {opt} state take {format_bytes(state)} and the optimizer step "
            f"{format_bytes(prof.optimizer_temp_bytes)} more while it runs; budget {format_bytes(budget)}: "
            "use an optimizer with less state (or a fused or for-loop step), or more memory."
        )
    return (
        f"even at {precision} with every block at its smallest mode and {micro} micro-batch(es), the step "
        f"peaks at {format_bytes(sim.peak_bytes)} during the {sim.peak_event} (parameters + gradients + "
        f"{opt} state {format_bytes(state)}, activations and temporaries "
        f"{format_bytes(sim.peak_bytes - state)}); budget {format_bytes(budget)}: "
        "raise the budget or shrink the model or sequence."
    )


def plan_from_profiles(
    profiles: Mapping[str, Profile],
    budget_bytes: int,
    baseline_peak_bytes: int = 0,
    baseline_step_seconds: float = 0.0,
) -> Plan:
    """The least-time plan over precisions and micro-batch counts (a pure function).

    Args:
        profiles: one measured profile per allowed precision.
        budget_bytes: the peak every event of the step must stay under.
        baseline_peak_bytes: the fp32, no-checkpointing peak (recorded in the Plan).
        baseline_step_seconds: its step time (for the predicted time ratio).

    Returns:
        The :class:`Plan` with its predicted peak and step time.

    Raises:
        InfeasibleBudget: nothing fits, even at one sample per micro-batch.
    """
    if not profiles:
        raise ConfigError("no profiles to plan from; profile the model at one precision at least.")
    batch = max(p.batch_size for p in profiles.values())
    for micro in _divisors(batch):
        found: list[tuple[float, str, Solution]] = []
        for precision, prof in profiles.items():
            sol = solve(prof, budget_bytes, micro)
            if sol is not None:
                found.append((predict_step_seconds(prof, sol.modes, micro), precision, sol))
            if micro == 1 and precision == "fp32" and 0 < baseline_peak_bytes <= budget_bytes:
                # NOTE: keeping every block was measured (the baseline) and fits, even where
                # the simulator, adding up per-block numbers, predicts a little more.
                keep = Solution(["none"] * len(prof.blocks), baseline_peak_bytes, 0.0)
                found.append((predict_step_seconds(prof, keep.modes, 1), precision, keep))
        if found:
            seconds, precision, sol = min(found, key=lambda f: f[0])
            return Plan(
                blocks=_to_plan_modes(profiles[precision], sol.modes),
                precision=precision,
                micro_batches=micro,
                predicted_peak_bytes=sol.peak_bytes,
                predicted_step_seconds=seconds,
                baseline_peak_bytes=baseline_peak_bytes,
                baseline_step_seconds=baseline_step_seconds,
                budget_bytes=budget_bytes,
            )
    # NOTE: the smallest peak of every plan considered (each precision, each micro-batch
    # count) and of keeping every block, which was measured: never above any of them.
    smallest = min(
        ((p, micro, minimum_peak(prof, micro)) for p, prof in profiles.items() for micro in _divisors(batch)),
        key=lambda t: (t[2].peak_bytes, t[1]),
    )
    minimum = smallest[2].peak_bytes
    if baseline_peak_bytes > 0:
        minimum = min(minimum, baseline_peak_bytes)
    raise InfeasibleBudget(
        f"no plan fits the budget: {_explain(smallest, profiles, budget_bytes)}",
        minimum_bytes=minimum,
        budget_bytes=budget_bytes,
    )


def _profile(
    model: nn.Module, batch: Batch, loss_fn: LossFn, optimizer: torch.optim.Optimizer | None, precision: str
) -> Profile:
    from memfit.measuring.profile import profile

    return profile(model, batch, loss_fn, optimizer, precision)


def plan(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    budget: int | str | Budget,
    optimizer: torch.optim.Optimizer | None = None,
    precision: str | Sequence[str] = "auto",
    *,
    check: bool = True,
    profiles: Mapping[str, Profile] | None = None,
) -> Plan:
    """The fastest plan whose step peak fits ``budget``: per-block checkpointing, precision, micro-batches.

    Args:
        model: the model (its current checkpointing is put back afterwards).
        batch: a representative batch (its size is the batch a training step uses).
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        budget: int bytes, ``"6GiB"``, ``"500MB"`` or ``"60%"`` of the fp32 no-checkpointing peak.
        optimizer: the optimizer training will use (its state and step count).
        precision: ``"auto"`` (fp32 and what the device runs natively), one mode, or a list.
        check: measure the chosen plan and re-plan under a tighter budget if it is over.
        profiles: already-measured profiles per precision (skips profiling).

    Returns:
        A :class:`Plan`; ``memfit.apply(model, plan)`` applies its checkpointing.

    Raises:
        InfeasibleBudget: nothing fits; ``.minimum_bytes`` is the smallest possible peak.
        ConfigError: the budget cannot be read or is not positive.
    """
    device = _device(model)
    wanted = candidate_precisions(precision, device)
    spec = Budget.parse(budget)  # a bad budget is refused before any profiling
    before = checkpointed_blocks(model)
    try:
        uncheckpoint(model)
        profs = dict(profiles or {})
        for p in wanted:
            if p not in profs:
                profs[p] = _profile(model, batch, loss_fn, optimizer, p)
        profs = {p: profs[p] for p in wanted}
        base = profs.get("fp32")
        if base is not None and base.measured_peak_bytes > 0:
            baseline_peak, baseline_seconds = base.measured_peak_bytes, base.step_seconds
        else:
            report = measure(model, batch, loss_fn, optimizer, "fp32", steps=1)
            baseline_peak, baseline_seconds = report.peak_bytes, report.step_seconds
        budget_bytes = spec.resolve(baseline_peak)
        result = plan_from_profiles(profs, budget_bytes, baseline_peak, baseline_seconds)
        if check:
            result = _checked(model, batch, loss_fn, optimizer, profs, result)
        result.budget_bytes = budget_bytes
        result.notes = _notes(model, result) + _copy_notes(profs[result.precision], result)
        return result
    finally:
        uncheckpoint(model)
        if before:
            set_block_modes(model, before)


def _notes(model: nn.Module, result: Plan) -> list[str]:
    notes = []
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if result.micro_batches > 1 and norms:
        notes.append(
            f"{len(norms)} BatchNorm layer(s) (e.g. {norms[0]!r}) normalise over each micro-batch, not the "
            f"whole batch, with {result.micro_batches} micro-batches; give a larger budget to avoid it."
        )
    return notes


def _copy_notes(prof: Profile, result: Plan) -> list[str]:
    """The profile's notes on in-place writes that concern a block the plan checkpoints."""
    from memfit.measuring.profile import inplace_parts

    def concerns(note: str) -> bool:
        blocks, modes = inplace_parts(note)
        return any(result.blocks.get(b) in modes for b in blocks)

    return [n for n in prof.notes if concerns(n)]


def _checked(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    profiles: Mapping[str, Profile],
    result: Plan,
) -> Plan:
    """Measure the plan; while it is over budget, re-plan under the budget less the excess.

    # NOTE: the simulator assumes blocks are additive; where they are not (tensors held
    # across blocks, e.g. U-Net skips), the measured peak can exceed the prediction. That
    # error, measured, becomes a safety margin, so the returned plan was seen to fit.
    """
    budget = result.budget_bytes
    margin = 0
    for _ in range(_CHECKS):
        apply(model, result)
        measured = measure(
            model, batch, loss_fn, optimizer, result.precision, steps=1, micro_batches=result.micro_batches
        ).peak_bytes
        result.measured_peak_bytes = measured
        if measured <= budget:
            return result
        # The simulator's error on this plan, or (if that is not enough) a step further.
        margin = max(measured - result.predicted_peak_bytes, margin + measured - budget)
        try:
            result = plan_from_profiles(
                profiles, budget - margin, result.baseline_peak_bytes, result.baseline_step_seconds
            )
        except InfeasibleBudget as exc:
            raise InfeasibleBudget(
                f"no plan fits the budget of {format_bytes(budget)}: the best plan measured "
                f"{format_bytes(measured)}, over its prediction, and a tighter plan does not exist "
                f"({exc}).",
                minimum_bytes=min(measured, exc.minimum_bytes + margin),
                budget_bytes=budget,
            ) from None
        result.budget_bytes = budget
    raise InfeasibleBudget(
        f"no plan was measured under the budget of {format_bytes(budget)} after {_CHECKS} tries; the "
        f"last measured {format_bytes(result.measured_peak_bytes)}: raise the budget.",
        minimum_bytes=result.measured_peak_bytes,
        budget_bytes=budget,
    )
