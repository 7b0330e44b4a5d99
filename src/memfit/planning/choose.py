"""Choose a plan from profiles: the fastest per precision and micro-batch count, ties to the lowest peak.

A pure function over records (:func:`plan_from_profiles`): for one micro-batch, then two,
four... (the batch is split only when nothing fits whole), the solver
(:mod:`memfit.planning.solver`) finds each precision's fastest plan; the fastest of those
wins, and plans within :data:`TIE` of the fastest step count as equally fast (the time
model resolves no finer), so the lowest peak among them wins, then the precision listed
first. The answer depends on exact bytes wherever time cannot tell: the same profiles, or
profiles whose timings differ by noise, give the same plan.

PyTorch's own configurations come first (:mod:`memfit.planning.standard`): where one fits
and the solver's plan is not predicted :data:`~memfit.planning.standard.PREFER_STANDARD`
of a step faster, the fastest standard configuration that fits is the plan.

Example:
    >>> from memfit.records import BlockStats, Profile
    >>> blk = [BlockStats(f"b{i}", saved_bytes={"none": 100, "full": 10},
    ...        backward_peak_bytes={"none": 50, "full": 150},
    ...        backward_seconds={"none": 1.0, "full": 2.0}) for i in range(2)]
    >>> prof = Profile("fp32", "cpu", 1, blk, BlockStats("outside"), 0, 0, 0, 0)
    >>> plan_from_profiles({"fp32": prof}, 200).blocks
    {'b0': 'full', 'b1': 'none'}
"""

from __future__ import annotations

import typing
from collections.abc import Mapping, Sequence

import torch

from memfit.budget import format_bytes
from memfit.devices import device_facts, recommend_precision
from memfit.errors import ConfigError, InfeasibleBudget, UnsupportedPrecision
from memfit.planning.solver import Solution, minimum_peak, solve
from memfit.planning.standard import PREFER_STANDARD, standard_solutions
from memfit.records import Plan, Profile
from memfit.stepmodel import predict_options_seconds, simulate_options, tiling
from memfit.vocab import PRECISIONS, PrecisionName, normalize_modes, normalize_precision

__all__ = ["TIE", "candidate_precisions", "fixed_bytes_message", "plan_from_profiles"]

#: Plans whose predicted step time is within this fraction of the fastest count as ties.
TIE = 0.02


def candidate_precisions(precision: str | Sequence[str], device: torch.device) -> list[PrecisionName]:
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
    return [typing.cast(PrecisionName, p) for p in dict.fromkeys(chosen)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, max(1, n) + 1) if n % d == 0] or [1]


def fixed_bytes_message(fixed: int, budget: int, optimizer: str, detail: str = "") -> str:
    """The sentence for a budget under parameters + gradients + optimizer state."""
    opt = optimizer if optimizer not in ("", "none") else "optimizer"
    return (
        f"no plan fits the budget: parameters + gradients + {opt} state alone take {format_bytes(fixed)}; "
        f"budget {format_bytes(budget)}{detail}: use a smaller model, an optimizer with less state, or more "
        "memory."
    )


def _explain(precision: str, micro: int, sol: Solution, profiles: Mapping[str, Profile], budget: int) -> str:
    prof = profiles[precision]
    sim = simulate_options(prof, sol.options, micro)
    # Note [state apart from the optimizer step]
    # "Alone" is what every step holds whatever the plan; the optimizer step's temporaries
    # are not held all step (a fused or for-loop step changes them), so they are named apart.
    state = prof.param_bytes + prof.grad_bytes + prof.optimizer_bytes
    if state >= budget:
        return fixed_bytes_message(state, budget, prof.optimizer)
    opt = prof.optimizer if prof.optimizer not in ("", "none") else "optimizer"
    if state + prof.optimizer_temp_bytes >= budget:
        return (
            f"no plan fits the budget: parameters + gradients + {opt} state take {format_bytes(state)} and "
            f"the optimizer step {format_bytes(prof.optimizer_temp_bytes)} more while it runs; budget "
            f"{format_bytes(budget)}: use an optimizer with less state (or a fused or for-loop step), or "
            "more memory."
        )
    return (
        f"no plan fits the budget: even at {precision} with every block at its smallest and {micro} "
        f"micro-batch(es), the step peaks at {format_bytes(sim.peak_bytes)} during the {sim.peak_event} "
        f"(parameters + gradients + {opt} state {format_bytes(state)}, activations and "
        f"temporaries {format_bytes(sim.peak_bytes - state)}); budget {format_bytes(budget)}: "
        "raise the budget or shrink the model or sequence."
    )


def _step_seconds(profiles: Mapping[str, Profile]) -> float:
    return max((p.step_seconds for p in profiles.values()), default=0.0)


#: A candidate plan: (predicted seconds, peak bytes, precision's rank, precision, solution).
_Found = tuple[float, int, int, str, Solution]


def _pick(custom: list[_Found], standard: list[_Found], tie: float, prefer: float) -> _Found:
    """The plan to return: a standard configuration unless the solver's is ``prefer`` faster.

    Within the pool chosen, plans within ``tie`` of its fastest are equally fast and the
    lowest peak wins, then the precision listed first.
    """
    fastest = min((f[0] for f in custom), default=float("inf"))
    near = [f for f in standard if f[0] <= fastest + prefer]
    pool = near or custom
    best = min(f[0] for f in pool)
    return min((f for f in pool if f[0] <= best + tie), key=lambda f: (f[1], f[2]))


def plan_from_profiles(
    profiles: Mapping[str, Profile],
    budget_bytes: int,
    baseline_peak_bytes: int = 0,
    baseline_step_seconds: float = 0.0,
    *,
    segments: bool = True,
) -> Plan:
    """The least-time plan over precisions and micro-batch counts (a pure function).

    Args:
        profiles: one measured profile per allowed precision (in order of preference).
        budget_bytes: the peak every event of the step must stay under.
        baseline_peak_bytes: the fp32, no-checkpointing peak (recorded in the Plan).
        baseline_step_seconds: its step time (for the predicted time ratio).
        segments: also consider segments of blocks checkpointed as one.

    Returns:
        The :class:`Plan` with its predicted peak and step time.

    Raises:
        InfeasibleBudget: nothing fits, even at one sample per micro-batch.
    """
    if not profiles:
        raise ConfigError("no profiles to plan from; profile the model at one precision at least.")
    batch = max(p.batch_size for p in profiles.values())
    tie = TIE * _step_seconds(profiles)
    prefer = PREFER_STANDARD * _step_seconds(profiles)
    order = {p: i for i, p in enumerate(profiles)}
    for micro in _divisors(batch):
        found: list[_Found] = []
        standard: list[_Found] = []
        for precision, prof in profiles.items():
            sol = solve(prof, budget_bytes, micro, tie_seconds=tie, segments=segments)
            if sol is not None:
                seconds = predict_options_seconds(prof, sol.options, micro)
                found.append((seconds, sol.peak_bytes, order[precision], precision, sol))
            for _, std in standard_solutions(prof, budget_bytes, micro, segments=segments):
                seconds = predict_options_seconds(prof, std.options, micro)
                standard.append((seconds, std.peak_bytes, order[precision], precision, std))
            if micro == 1 and precision == "fp32" and 0 < baseline_peak_bytes <= budget_bytes:
                # Note [the measured baseline]
                # Keeping every block was measured (the baseline); where it fits, it is a plan,
                # even where the step model, adding up per-block numbers, predicts a little more.
                keep = _keep_all(prof, baseline_peak_bytes)
                seconds = predict_options_seconds(prof, keep.options, 1)
                found.append((seconds, baseline_peak_bytes, order[precision], precision, keep))
                standard.append(found[-1])
        if found or standard:
            _, _, _, precision, sol = _pick(found, standard, tie, prefer)
            prof = profiles[precision]
            names = [b.name for b in prof.blocks]
            return Plan(
                blocks=normalize_modes(dict(zip(names, sol.modes, strict=True))),
                segments=[names[a : b + 1] for a, b in sol.segments],
                precision=normalize_precision(precision),
                micro_batches=micro,
                predicted_peak_bytes=sol.peak_bytes,
                predicted_step_seconds=predict_options_seconds(prof, sol.options, micro),
                baseline_peak_bytes=baseline_peak_bytes,
                baseline_step_seconds=baseline_step_seconds,
                budget_bytes=budget_bytes,
            )
    # The smallest peak of every plan considered (each precision and micro-batch count) and of
    # keeping every block: never above any of them.
    # See Note [the measured baseline]
    p, micro, best = min(
        (
            (p, micro, minimum_peak(prof, micro, segments=segments))
            for p, prof in profiles.items()
            for micro in _divisors(batch)
        ),
        key=lambda t: (t[2].peak_bytes, t[1]),
    )
    minimum = min(best.peak_bytes, baseline_peak_bytes) if baseline_peak_bytes > 0 else best.peak_bytes
    raise InfeasibleBudget(
        _explain(p, micro, best, profiles, budget_bytes), minimum_bytes=minimum, budget_bytes=budget_bytes
    )


def _keep_all(prof: Profile, peak: int) -> Solution:
    """Every block kept (mode none), with its measured peak."""
    options = tiling(prof, "none")
    return Solution(["none"] * len(prof.blocks), peak, 0.0, options=options)
