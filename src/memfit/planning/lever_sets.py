"""Plans with levers (:mod:`memfit.levers`): the least risky lever set that fits the budget.

Levers change numerics (``state_*``, ``weights_bf16``) or the step's structure
(``fused_step``, ``chunked_loss``), so the planner uses them only when asked (``levers=``)
and only as far as the budget needs: it tries lever sets from the least to the most
numeric risk (no lever; the frozen weights in bf16; the state in bf16, then 8 bits, then
4 bits; bf16 weights; the frozen weights in NF4: See Note [NF4 last]), each
without and then with the fused step (exact, but its clipping runs the backward twice),
each of those without and then with the chunked loss head (exact to fp32 rounding; the
model's output loses its logits; at the largest chunk size that fits, as
:func:`plan_lever_set` tells), and keeps the first whose plan fits. Every set is
predicted from the same profiles (:func:`memfit.stepmodel.with_levers.with_levers`, a pure
function): no lever set costs a step.

``offload`` is applied when a plan names it (``Plan.offload``) but the planner does not
choose it (it is CUDA-only, and its bytes are not in the step model yet).

Example:
    >>> [sorted(s) for s in lever_sets(["fused_step", "state_8bit"])]
    [[], ['fused_step'], ['state_8bit'], ['fused_step', 'state_8bit']]
"""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from memfit.budget import format_bytes
from memfit.errors import InfeasibleBudget, LeverRefused
from memfit.levers.apply import apply_levers, frozen_levers, remove_levers
from memfit.levers.frozen import park_frozen, restore_frozen
from memfit.levers.spec import STATE_LEVERS, allowed_levers
from memfit.levers.weights import cast_weights, restore_weights
from memfit.measuring.preserve import create_optimizer_state
from memfit.planning.choose import plan_from_profiles
from memfit.records import EstimateEntry, Plan, Profile
from memfit.stepmodel import simulate
from memfit.stepmodel.head_chunks import at_chunk, chunk_ladder
from memfit.stepmodel.with_levers import with_levers
from memfit.vocab import LEVERS, LeverName, PrecisionChoice, PrecisionName

__all__ = [
    "frozen_applied",
    "head_chunk_ladder",
    "lever_profiles",
    "lever_sets",
    "levers_applied",
    "plan_lever_set",
    "plan_with_levers",
    "replan_without",
    "resolve_levers",
    "savings",
    "smallest_with_levers",
    "usable_levers",
]

#: Numeric risk of each state kind (none first).
_STATE_RISK = {None: 0, "state_bf16": 1, "state_8bit": 2, "state_4bit": 3}
# Note [NF4 last]
# A frozen base in bf16 rounds weights that never train (and holds nothing else): it comes
# right after no lever, before the optimizer state's levers and bf16 weights (which round
# the trained weights too). In NF4 the base moves by a quantization error of a few percent:
# the most a lever changes, so frozen_nf4 comes after every set without it, and the planner
# quantizes the base only when nothing else fits the budget.
_FROZEN_RISK: dict[tuple[str, ...], int] = {
    (): 0,
    ("frozen_bf16",): 1,
    ("frozen_nf4",): 20,
    ("frozen_bf16", "frozen_nf4"): 21,
}


def lever_sets(allowed: Sequence[str]) -> list[list[str]]:
    """Every lever set the planner may use from ``allowed``, least numeric risk first."""
    states: list[str | None] = [None, *[n for n in STATE_LEVERS if n in allowed]]
    weights = [False, True] if "weights_bf16" in allowed else [False]
    fused = [False, True] if "fused_step" in allowed else [False]
    heads = [False, True] if "chunked_loss" in allowed else [False]
    frozen = [f for f in _FROZEN_RISK if set(f) <= set(allowed)]
    sets = []
    for w, s, f, h, z in itertools.product(weights, states, fused, heads, frozen):
        if w and "frozen_bf16" in z:
            continue  # bf16 weights are bf16 frozen weights too
        names = {"fused_step"} if f else set()
        names |= {s} if s else set()
        names |= {"weights_bf16"} if w else set()
        names |= {"chunked_loss"} if h else set()
        names |= set(z)
        key = (2 * _STATE_RISK[s] + 7 * w + _FROZEN_RISK[z], f, h)
        sets.append((key, [str(n) for n in LEVERS if n in names]))
    return [names for _, names in sorted(sets, key=lambda kv: kv[0])]


def usable_levers(
    profiles: Mapping[str, Profile], allowed: Sequence[str]
) -> tuple[list[str], dict[str, str]]:
    """``allowed`` less ``chunked_loss`` where the profiles cannot predict it, with the reason
    (its head facts say the loss does not go through the model's head, or were not measured),
    and less the frozen-weight levers where the model has no weights they change."""
    out, refused = list(allowed), _unusable_frozen(profiles, allowed)
    if "chunked_loss" in allowed:
        for prof in profiles.values():
            head = prof.lever_facts.head if prof.lever_facts is not None else None
            why = "its loss head was not measured" if head is None else head.refused
            if why:
                refused["chunked_loss"] = why
                break
    return [n for n in out if n not in refused], refused


def _unusable_frozen(profiles: Mapping[str, Profile], allowed: Sequence[str]) -> dict[str, str]:
    """``{lever: why}`` for the frozen-weight levers of ``allowed`` the profiles cannot predict."""
    refused = {}
    for prof in profiles.values():
        frozen = prof.lever_facts.frozen if prof.lever_facts is not None else None
        for lever in {"frozen_bf16", "frozen_nf4"} & set(allowed):
            if frozen is None:
                refused[lever] = "the model has no frozen weights (requires_grad=False)"
            elif lever == "frozen_nf4" and not frozen.nf4:
                refused[lever] = "the model has no frozen nn.Linear weight NF4 can hold"
    return refused


def resolve_levers(
    levers: str | Sequence[LeverName] | None,
    device: torch.device,
    optimizer: torch.optim.Optimizer | None,
    precision: PrecisionChoice | Sequence[PrecisionName],
    model: nn.Module | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The levers a plan may use, and ``{lever: why not}`` for those of ``"all"`` that cannot run.

    Raises:
        LeverRefused: a lever named explicitly cannot run here.
        ConfigError: an unknown lever name.
    """
    mode = precision if isinstance(precision, str) else ("auto" if "bf16" in precision else precision[0])
    allowed, refused = allowed_levers(levers, device=device, optimizer=optimizer, precision=mode, model=model)
    if not (isinstance(levers, str) and levers.strip() == "all"):
        for lever, why in refused.items():
            raise LeverRefused(why, lever)
    return allowed, refused


def lever_profiles(profiles: Mapping[str, Profile], levers: Sequence[str]) -> dict[str, Profile]:
    """The profiles a lever set can run at (``weights_bf16`` and ``frozen_bf16`` compute in
    bf16, ``frozen_nf4`` not in fp16), levers applied."""
    return {
        p: with_levers(prof, levers)
        for p, prof in profiles.items()
        if (not {"weights_bf16", "frozen_bf16"} & set(levers) or p == "bf16")
        and ("frozen_nf4" not in levers or p != "fp16")
    }


def savings(profiles: Mapping[str, Profile], plan: Plan) -> dict[str, int]:
    """Per lever of ``plan``: predicted peak of the same plan without it, minus the plan's."""
    out = {}
    base = at_chunk(profiles[plan.precision], plan.loss_chunk_tokens)
    chosen = with_levers(base, plan.levers)
    peak = simulate(chosen, plan.blocks, plan.micro_batches, plan.segments).peak_bytes
    for lever in plan.levers:
        rest = [n for n in plan.levers if n != lever]
        if {"weights_bf16", "frozen_bf16"} & set(rest) and base.precision != "bf16":
            continue
        without = simulate(with_levers(base, rest), plan.blocks, plan.micro_batches, plan.segments)
        out[lever] = without.peak_bytes - peak
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
            return plan_lever_set(profiles, levers, budget_bytes, baseline, split=split)
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


def head_chunk_ladder(profiles: Mapping[str, Profile]) -> list[int]:
    """The chunk sizes of ``chunked_loss`` the planner tries, largest first
    (:func:`memfit.stepmodel.head_chunks.chunk_ladder` from the measured default; ``[0]``, the
    default as measured, for head facts measured at one chunk size only)."""
    for prof in profiles.values():
        head = prof.lever_facts.head if prof.lever_facts is not None else None
        if head is not None and head.default_chunk_tokens and head.small_chunk_tokens:
            # the default itself first (a plan for a batch of more tokens keeps it)
            return [head.chunk_tokens, *chunk_ladder(head.default_chunk_tokens)[1:]]
    return [0]


# Note [the largest chunk that fits]
# The chunk size of chunked_loss changes no numerics, only the head's bytes and speed: one
# chunk's logits are made at a time, and a smaller chunk runs more, smaller matmuls (one
# Python iteration each). So it is a setting of the lever, chosen inside each lever set
# that has it: the default chunk first (2**23 // vocab tokens, 32 MiB of fp32 logits:
# matmuls large enough to run at speed; much smaller chunks are slower), then each smaller
# rung of the ladder (memfit.stepmodel.head_chunks.chunk_ladder: /4 per rung, down to 1
# token), and the first rung with a plan that fits is kept: the largest chunk that fits,
# the default when it does. At the default chunk the plan may use checkpointing or
# micro-batches (the time model prices micro-batches as the same work), so a smaller
# chunk is chosen only when no plan at a larger one fits (e.g. a batch of one row). A
# lever set without chunked_loss comes before it in the order, so a small head is never
# chunked when a plan without the lever fits.


def plan_lever_set(
    profiles: Mapping[str, Profile],
    levers: Sequence[str],
    budget_bytes: int,
    baseline: tuple[int, float],
    segments: bool = True,
    split: bool = True,
) -> tuple[Plan, dict[str, Profile]]:
    """The fastest plan with ``levers`` that fits (with ``chunked_loss``, at the largest chunk
    size that fits: See Note [the largest chunk that fits]), and the profiles it was planned from.

    Raises:
        InfeasibleBudget: no plan with these levers fits (the smallest peak found), or none can
            run at the profiles' precisions.
    """
    chunks = head_chunk_ladder(profiles) if "chunked_loss" in levers else [0]
    smallest: InfeasibleBudget | None = None
    for chunk in chunks:
        profs = lever_profiles({p: at_chunk(prof, chunk) for p, prof in profiles.items()}, levers)
        if not profs:
            break
        try:
            result = plan_from_profiles(profs, budget_bytes, *baseline, segments=segments, split=split)
        except InfeasibleBudget as exc:
            if smallest is None or exc.minimum_bytes < smallest.minimum_bytes:
                smallest = exc
            continue
        result.levers, result.loss_chunk_tokens = list(levers), chunk
        result.lever_savings = savings(profiles, result) if levers else {}
        return result, profs
    if smallest is None:
        raise InfeasibleBudget(
            f"the levers {', '.join(levers)} cannot run at the profiled precisions.",
            minimum_bytes=2**63,
            budget_bytes=budget_bytes,
        )
    raise smallest


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
) -> tuple[Plan, dict[str, Profile]]:
    """:func:`plan_with_levers` once verification refused ``failed`` (``{lever: why}``).

    Raises:
        LeverRefused: no plan fits without the refused levers (the message says why each failed).
    """
    try:
        return plan_with_levers(profiles, budget_bytes, baseline, allowed)
    except InfeasibleBudget:
        lever, why = next(iter(failed.items()))
        raise LeverRefused(
            f"{lever} is refused on this model: {why}; no plan fits {format_bytes(budget_bytes)} without it, "
            "so raise the budget or fix what the check found.",
            lever,
        ) from None


@contextlib.contextmanager
def frozen_applied(model: nn.Module, levers: Sequence[str]) -> Iterator[None]:
    """Run the body with the frozen-weight levers of ``levers`` on ``model`` (undone after):
    a loss to compare with a step of the plan is computed with the same frozen weights."""
    saved = frozen_levers(model, None, [n for n in levers if n in ("frozen_bf16", "frozen_nf4")])
    try:
        yield
    finally:
        restore_frozen(saved)


@contextlib.contextmanager
def levers_applied(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, plan: Plan
) -> Iterator[torch.optim.Optimizer | None]:
    """Run the body with ``plan.levers`` on ``model`` and a copy of ``optimizer``; undo them after.

    The optimizer yielded has its state (one step on zero gradients); the weights' dtype,
    the hooks and the user's optimizer are as before afterwards.
    """
    if not plan.levers or optimizer is None:
        yield optimizer
        return
    saved = cast_weights(model) if "weights_bf16" in plan.levers else []
    # Note [a fresh optimizer for state levers]
    # A state lever makes a new optimizer from one without state: a shallow copy whose state
    # is empty, so the user's optimizer and its state are left alone.
    fresh = copy.copy(optimizer)
    fresh.state = collections.defaultdict(dict)
    fresh.param_groups = [dict(g) for g in optimizer.param_groups]
    frozen = frozen_levers(model, fresh, list(plan.levers))
    park_frozen(frozen)
    try:
        used = apply_levers(model, fresh, plan)
        try:
            create_optimizer_state(model, used)
            yield used
        finally:
            remove_levers(model, used)
    finally:
        restore_frozen(frozen)
        restore_weights(saved)
