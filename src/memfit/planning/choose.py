"""Choose a plan from profiles: the fastest per precision and micro-batch count, ties to counted work.

A pure function over records (:func:`plan_from_profiles`): for one micro-batch, then two,
four... (the batch is split only when nothing fits whole), the solver
(:mod:`memfit.planning.solver`) finds each precision's fastest plan; the fastest of those
wins, and plans within :data:`TIE` of the fastest step, or within the measured spread of
the timings (``Speed.spread``) of their checkpointing extras, count as equally fast (the
time model resolves no finer), so the least counted work among them wins (selective
checkpointing's ops, then recomputed FLOPs), then the lowest peak, then the precision
listed first. The answer depends on exact counts wherever time cannot tell: the same
profiles, or profiles whose timings differ by noise, give the same plan
(See Note [plans repeat]).

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
from typing import NamedTuple

import torch

from memfit.budget import format_bytes
from memfit.devices import device_facts, recommend_precision
from memfit.errors import ConfigError, InfeasibleBudget, UnsupportedPrecision
from memfit.planning.solver import Solution, as_fast, counted_work, minimum_peak, solve
from memfit.planning.standard import PREFER_STANDARD, standard_solutions
from memfit.records import Plan, PlanReport, Profile
from memfit.stepmodel import block_options, predict_options_seconds, simulate_options, tiling
from memfit.vocab import PRECISIONS, PrecisionName, normalize_modes, normalize_precision

__all__ = ["NOISE_CAP", "TIE", "candidate_precisions", "fixed_bytes_message", "plan_from_profiles"]

#: Plans whose predicted step time is within this fraction of the fastest count as ties.
TIE = 0.02
#: The most of a plan's checkpointing extra that timing noise can account for: extras more
#: than ``(1 + NOISE_CAP) / (1 - NOISE_CAP)`` (3) times apart are told apart by time however
#: far the timings spread (See Note [plans repeat]).
NOISE_CAP = 0.5


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


# Note [plans repeat]
# The time model's prices (a recompute's, a checkpoint call's, selective checkpointing's
# per op) are timed, and on a loaded machine they swing by tens of percent from one call
# to the next, while the counts they price (FLOPs, bytes, ops) are exact. So a difference
# in predicted time counts only where it is larger than the timings could make it: the
# rounds of the block timed alone give the spread of the extras the prices were fitted to
# (Speed.spread, half their range over their median; 1 where a fit was clamped), and two
# plans tie where their times differ by less than TIE of a step plus that spread of both
# plans' checkpointing extras (solver.as_fast: a price off by that fraction moves each
# extra by as much). Among ties the key is exact: the least counted work
# (solver.counted_work: first the ops selective checkpointing dispatches, the price a CPU
# makes dearest and FLOPs do not see, then the FLOPs recomputed, FlopCounterMode's
# counts), then the lowest peak, then the precision listed first (and, in the solver, a
# fixed order of blocks and modes). Counted work orders plans only one count after the
# other and prices no checkpoint call, so the spread is taken at most NOISE_CAP: extras
# three times apart stay told apart by time. On a quiet machine the spread is small and
# time decides as before; on a loaded one the band widens and counted work decides, and
# what counts cannot tell apart (a checkpoint call more or less: a segment) goes to the
# lowest peak. PyTorch's own configurations are preferred over a plan of the solver's
# predicted at most PREFER_STANDARD faster, the noise counted the way the counts point:
# for a configuration with no more counted work, within PREFER_STANDARD plus the noise;
# with more, only within PREFER_STANDARD less the noise (so on a loaded machine the plan
# that does less keeps its exact advantage). The same call then gives the same plan, on
# adapters as on full fine-tuning, wherever plans differ either clearly more than the
# noise or not at all in what is counted; only a difference near the edge of the band can
# still fall either way.


class _Found(NamedTuple):
    """A candidate plan, with what the choice among candidates reads."""

    seconds: float
    """Predicted step seconds."""
    extra: float
    """Of which checkpointing's extra: over every block at its cheapest mode."""
    work: tuple[int, int]
    """What its options add, counted (:func:`~memfit.planning.solver.counted_work`)."""
    peak: int
    rank: int
    """The precision's place in the order given."""
    precision: str
    sol: Solution
    noise: float
    """The profile's timing spread (See Note [plans repeat])."""


def _found(prof: Profile, precision: str, rank: int, sol: Solution, micro: int, peak: int = -1) -> _Found:
    seconds = predict_options_seconds(prof, sol.options, micro)
    cheapest = tiling(prof, [(block_options(b) or ["none"])[0] for b in prof.blocks])
    extra = max(0.0, seconds - predict_options_seconds(prof, cheapest, micro))
    counted = [counted_work(prof, o) for o in sol.options]
    work = (sum(c[0] for c in counted), sum(c[1] for c in counted))
    peak = sol.peak_bytes if peak < 0 else peak
    noise = _noise(prof)
    return _Found(seconds, extra, work, peak, rank, precision, sol, noise)


def _noise(prof: Profile) -> float:
    return min(NOISE_CAP, prof.speed.spread) if prof.speed is not None else 0.0


def _ties(fastest: _Found, other: _Found, tie: float) -> bool:
    noise = max(fastest.noise, other.noise)
    return as_fast((fastest.seconds, fastest.extra), (other.seconds, other.extra), tie, noise)


def _near(custom: _Found, standard: _Found, prefer: float) -> bool:
    """Whether ``standard`` is the plan rather than ``custom``: at most ``prefer`` slower, the
    timing noise counted in its favour where its counted work is no more, against it where
    it is more (See Note [plans repeat])."""
    noise = max(custom.noise, standard.noise) * (custom.extra + standard.extra)
    slower = standard.seconds - custom.seconds
    return slower <= prefer + (noise if standard.work <= custom.work else -noise)


def _pick(custom: list[_Found], standard: list[_Found], tie: float, prefer: float) -> _Found:
    """The plan to return: a standard configuration unless the solver's is ``prefer`` faster.

    Within the pool chosen, plans that tie its fastest are equally fast, and the fewest
    counted work wins, then the lowest peak, then the precision listed first
    (See Note [plans repeat]).
    """
    fastest = min(custom, key=lambda f: f.seconds, default=None)
    near = [f for f in standard if fastest is None or _near(fastest, f, prefer)]
    pool = near or custom
    best = min(pool, key=lambda f: f.seconds)
    return min((f for f in pool if _ties(best, f, tie)), key=lambda f: (f.work, f.peak, f.rank))


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
            sol = solve(prof, budget_bytes, micro, tie_seconds=tie, segments=segments, noise=_noise(prof))
            if sol is not None:
                found.append(_found(prof, precision, order[precision], sol, micro))
            for _, std in standard_solutions(prof, budget_bytes, micro, segments=segments):
                standard.append(_found(prof, precision, order[precision], std, micro))
            if micro == 1 and precision == "fp32" and 0 < baseline_peak_bytes <= budget_bytes:
                # Note [the measured baseline]
                # Keeping every block was measured (the baseline); where it fits, it is a plan,
                # even where the step model, adding up per-block numbers, predicts a little more.
                keep = _keep_all(prof, baseline_peak_bytes)
                found.append(_found(prof, precision, order[precision], keep, 1, baseline_peak_bytes))
                standard.append(found[-1])
        if found or standard:
            chosen = _pick(found, standard, tie, prefer)
            precision, sol = chosen.precision, chosen.sol
            prof = profiles[precision]
            names = [b.name for b in prof.blocks]
            return Plan(
                blocks=normalize_modes(dict(zip(names, sol.modes, strict=True))),
                segments=[names[a : b + 1] for a, b in sol.segments],
                precision=normalize_precision(precision),
                micro_batches=micro,
                report=PlanReport(
                    predicted_peak_bytes=sol.peak_bytes,
                    predicted_step_seconds=predict_options_seconds(prof, sol.options, micro),
                    baseline_peak_bytes=baseline_peak_bytes,
                    baseline_step_seconds=baseline_step_seconds,
                    budget_bytes=budget_bytes,
                ),
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
