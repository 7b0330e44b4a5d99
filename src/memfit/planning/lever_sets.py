"""Plans with levers (:mod:`memfit.applying`): the least risky lever set that fits the budget.

Levers change numerics (``state_*``, ``weights_bf16``, the frozen weights) or the step's
structure (``fused_step``, ``chunked_loss``), so the planner uses them only when asked
(``levers=``) and only as far as the budget needs: it tries the lever sets of
:func:`memfit.applying.registry.lever_sets` from the least to the most numeric risk (See
Note [lever sets in risk order]), each at its levers' settings in turn (the loss head's
chunk: See Note [the largest chunk that fits]), and keeps the first whose plan fits. Every
set is predicted from the same profiles (:func:`memfit.applying.registry.with_levers`, a pure
function): no lever set costs a step.

Example:
    >>> from memfit.records import BlockStats, Profile
    >>> prof = Profile("fp32", "cpu", 1, [], BlockStats("outside"), 0, 0, 0, 0)
    >>> plan, _ = plan_with_levers({"fp32": prof}, 100, (0, 0.0), [])
    >>> plan.levers, plan.predicted_peak_bytes
    ([], 0)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import replace

from memfit.applying.offload import OFFLOAD
from memfit.applying.registry import (
    lever,
    lever_sets,
    levers_in_order,
    normalize_levers,
    usable_levers,
    with_levers,
)
from memfit.budget import format_bytes
from memfit.errors import InfeasibleBudget, LeverRefused
from memfit.planning.choose import TIE, plan_from_profiles
from memfit.planning.offloaded import offloaded_peak, plan_offloaded
from memfit.records import EstimateEntry, Plan, Profile
from memfit.records.plan import LeverSettings
from memfit.stepmodel import simulate

__all__ = [
    "lever_profiles",
    "plan_lever_set",
    "plan_with_levers",
    "replan_without",
    "savings",
    "smallest_with_levers",
]


def lever_profiles(profiles: Mapping[str, Profile], levers: Sequence[str]) -> dict[str, Profile]:
    """The profiles of the precisions every lever of the set runs at, levers applied."""
    return {
        p: with_levers(prof, levers)
        for p, prof in profiles.items()
        if all(lever(n).runs_at(p) for n in levers)
    }


def _at_settings(profile: Profile, levers: Sequence[str], settings: Mapping[str, LeverSettings]) -> Profile:
    for name in levers:
        profile = lever(name).at_settings(profile, settings.get(name, {}))
    return profile


def _peak(profile: Profile, plan: Plan, levers: Sequence[str]) -> int:
    """The predicted peak of ``plan``'s decision with ``levers`` (offload priced over the step)."""
    under = with_levers(profile, levers)
    if OFFLOAD.name in levers:
        return offloaded_peak(under, plan)
    return simulate(under, plan.blocks, plan.micro_batches, plan.segments).peak_bytes


def savings(profiles: Mapping[str, Profile], plan: Plan) -> dict[str, int]:
    """Per lever of ``plan``: predicted peak of the same plan without it, minus the plan's."""
    out = {}
    base = _at_settings(profiles[plan.precision], plan.levers, plan.lever_settings)
    peak = _peak(base, plan, plan.levers)
    for name in plan.levers:
        rest = [n for n in plan.levers if n != name]
        if not all(lever(n).runs_at(base.precision) for n in rest):
            continue
        out[name] = _peak(base, plan, rest) - peak
    return out


def plan_with_levers(
    profiles: Mapping[str, Profile],
    budget_bytes: int,
    baseline: tuple[int, float],
    allowed: Sequence[str],
    split: bool = True,
) -> tuple[Plan, dict[str, Profile]]:
    """The plan of the least risky lever set that fits, and the profiles it was planned from
    (``split``: micro-batches allowed, as :func:`~memfit.planning.choose.plan_from_profiles`).

    Raises:
        InfeasibleBudget: no lever set fits (the message names the smallest peak found).
    """
    smallest: InfeasibleBudget | None = None
    for levers in lever_sets(allowed) if allowed else [[]]:
        try:
            found = plan_lever_set(profiles, levers, budget_bytes, baseline, split=split)
            return _faster_offloaded(found, profiles, levers, budget_bytes, baseline, allowed, split)
        except InfeasibleBudget as exc:
            if smallest is None or exc.minimum_bytes < smallest.minimum_bytes:
                smallest = exc
    assert smallest is not None
    if not allowed:
        raise smallest
    raise InfeasibleBudget(
        f"no plan fits the budget of {format_bytes(budget_bytes)} even with the levers "
        f"{', '.join(allowed)}; the smallest step needs {format_bytes(smallest.minimum_bytes)}.",
        minimum_bytes=smallest.minimum_bytes,
        budget_bytes=budget_bytes,
    )


def _faster_offloaded(
    found: tuple[Plan, dict[str, Profile]],
    profiles: Mapping[str, Profile],
    levers: Sequence[str],
    budget_bytes: int,
    baseline: tuple[int, float],
    allowed: Sequence[str],
    split: bool = True,
) -> tuple[Plan, dict[str, Profile]]:
    """``found``, or the same lever set with offload where that is faster by more than a tie
    (See Note [offload against recompute] in :mod:`memfit.planning.offloaded`); ``split``:
    micro-batches allowed."""
    with_offload = [n for n in normalize_levers([*levers, OFFLOAD.name])]
    if OFFLOAD.name not in allowed or OFFLOAD.name in levers or with_offload not in lever_sets(allowed):
        return found
    try:
        other = plan_lever_set(profiles, with_offload, budget_bytes, baseline, split=split)
    except InfeasibleBudget:
        return found
    seconds = found[0].report.predicted_step_seconds
    return other if other[0].report.predicted_step_seconds < seconds * (1 - TIE) else found


def _settings_to_try(
    profiles: Mapping[str, Profile], levers: Sequence[str]
) -> list[dict[str, LeverSettings]]:
    """Every combination of the set's levers' settings, in the order each lever lists them; the
    levers' own order (``Lever.order``) says whose setting varies slowest (the loss head's chunk
    before the tiled MLP's count: See Note [the fewest chunks that fit])."""
    ladders = [[(lv.name, s) for s in lv.settings(profiles)] for lv in levers_in_order(levers)]
    return [{name: s for name, s in combo if s} for combo in itertools.product(*ladders)]


def plan_lever_set(
    profiles: Mapping[str, Profile],
    levers: Sequence[str],
    budget_bytes: int,
    baseline: tuple[int, float],
    segments: bool = True,
    split: bool = True,
) -> tuple[Plan, dict[str, Profile]]:
    """The fastest plan with ``levers`` that fits, at the first of their settings that fits (the
    loss head's largest chunk: See Note [the largest chunk that fits]), and the profiles it was
    planned from.

    Raises:
        InfeasibleBudget: no plan with these levers fits (the smallest peak found), or none can
            run at the profiles' precisions.
    """
    smallest: InfeasibleBudget | None = None
    for settings in _settings_to_try(profiles, levers):
        moved = {p: _at_settings(prof, levers, settings) for p, prof in profiles.items()}
        profs = lever_profiles(moved, levers)
        if not profs:
            break
        try:
            if OFFLOAD.name in levers:
                result = plan_offloaded(profs, budget_bytes, baseline, split=split)
            else:
                result = plan_from_profiles(profs, budget_bytes, *baseline, segments=segments, split=split)
        except InfeasibleBudget as exc:
            if smallest is None or exc.minimum_bytes < smallest.minimum_bytes:
                smallest = exc
            continue
        chosen = {**_nonzero(settings), **result.lever_settings}
        result = replace(result, levers=list(levers), lever_settings=chosen)
        saved = savings(profiles, result) if levers else {}
        return replace(result, report=replace(result.report, lever_savings=saved)), profs
    if smallest is None:
        raise InfeasibleBudget(
            f"the levers {', '.join(levers)} cannot run at the profiled precisions.",
            minimum_bytes=2**63,
            budget_bytes=budget_bytes,
        )
    raise smallest


def _nonzero(settings: Mapping[str, LeverSettings]) -> dict[str, LeverSettings]:
    """The settings a plan keeps: those that say something (a chunk of 0 is the default)."""
    kept = {name: {k: v for k, v in s.items() if v} for name, s in settings.items()}
    return {name: s for name, s in kept.items() if s}


def smallest_with_levers(profiles: Mapping[str, Profile], allowed: Sequence[str]) -> EstimateEntry | None:
    """The smallest predicted step over lever sets, precisions and uniform modes (one micro-batch).

    For ``memfit estimate``: what the levers make possible for a model too large to run.
    None when no lever set can be predicted (no lever facts, or no lever allowed).
    """
    best: EstimateEntry | None = None
    allowed, _ = usable_levers(profiles, allowed)
    for levers in lever_sets(allowed):
        if not levers or any(p.lever_facts is None for p in profiles.values()):
            continue
        for precision, prof in lever_profiles(profiles, levers).items():
            for mode in sorted({m for b in prof.blocks for m in b.saved_bytes} or {"none"}):
                sim = simulate(prof, mode)
                if best is None or sim.peak_bytes < best.peak_bytes:
                    best = EstimateEntry(precision, mode, sim.peak_bytes, sim.breakdown, levers=list(levers))
    return best


def replan_without(
    profiles: Mapping[str, Profile],
    budget_bytes: int,
    baseline: tuple[int, float],
    allowed: Sequence[str],
    failed: Mapping[str, str],
    split: bool = True,
) -> tuple[Plan, dict[str, Profile]]:
    """:func:`plan_with_levers` once verification refused ``failed`` (``{lever: why}``).

    Raises:
        LeverRefused: no plan fits without the refused levers (the message says why each failed).
    """
    try:
        return plan_with_levers(profiles, budget_bytes, baseline, allowed, split)
    except InfeasibleBudget:
        name, why = next(iter(failed.items()))
        raise LeverRefused(
            f"{name} is refused on this model: {why}; no plan fits {format_bytes(budget_bytes)} without it, "
            "so raise the budget or fix what the check found.",
            name,
        ) from None
