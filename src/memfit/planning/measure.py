"""The planner's first step: measure what the budget needs, cheapest first (:func:`measure`).

The step without checkpointing at every precision asked for (the fp32 one is the baseline a
percentage is taken of), timed; then, for a precision whose plain step does not fit, every
checkpointing mode and more timed rounds, the fastest precision first, stopping where a
plan already found is faster than any plan of the next precision can be. Profiles given by
the caller are used as they are. The story, and what runs on fake tensors, is
docs/planning.md.

Example:
    >>> import torch
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> from memfit.planning.request import resolve_request
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> x = torch.randint(0, 256, (4, 16))
    >>> found = measure(resolve_request(model, (x, x), gpt_loss, "90%", None, "fp32"))
    >>> list(found.profiles), found.budget_bytes == int(0.9 * found.baseline[0])
    (['fp32'], True)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial

from memfit.applying.chunked_loss import CHUNKED_LOSS
from memfit.applying.registry import with_levers
from memfit.budget import format_bytes
from memfit.errors import InfeasibleBudget
from memfit.levers.head import chunked_head_on
from memfit.measuring.lever_facts import head_facts
from memfit.measuring.preserve import create_optimizer_state
from memfit.measuring.profile import Profiler, TimingLever
from memfit.measuring.quick_peak import quick_peak
from memfit.planning.budgets import fixed_bytes
from memfit.planning.choose import TIE, fixed_bytes_message, plan_from_profiles
from memfit.planning.notes import complete_profile
from memfit.planning.request import Request
from memfit.precision import Precision
from memfit.records import HeadFacts, LeverFacts, Profile
from memfit.stepmodel import simulate
from memfit.vocab import CHECKPOINT_MODES

__all__ = ["Measured", "measure"]

#: Whole steps timed per precision for the time model (more come with the checkpointed rounds).
_TIMED_STEPS = 1
#: More whole steps timed where checkpointing is needed (with the heaviest block timed alone).
_MORE_TIMED_STEPS = 2


@dataclass(frozen=True)
class Measured:
    """What the planner measured: the profiles to plan from, the baseline and the budget in bytes."""

    profiles: dict[str, Profile]
    """One profile per precision of the request, in its order."""
    baseline: tuple[int, float]
    """The fp32 step without checkpointing: its peak bytes and (when fp32 was timed) seconds."""
    budget_bytes: int
    lines: tuple[str, ...]
    """What was run, one line each (for the plan's report)."""
    head: Mapping[str, HeadFacts] = field(default_factory=dict)
    """The loss head's facts per precision, where they were measured to time steps with the
    head in chunks (the lever facts reuse them)."""


def measure(request: Request, given: Mapping[str, Profile] | None = None) -> Measured:
    """The profiles to plan from: those ``given`` (every precision of the request), or measured;
    a ``dict`` given also receives the complete profiles measured (every mode: for a later
    re-plan), and then every precision is measured in every mode.

    Raises:
        InfeasibleBudget: the budget is under the weights, gradients and optimizer state.
        ConfigError: a percentage of the baseline over what the device holds.
    """
    if given is not None and all(p in given for p in request.precisions):
        profs: dict[str, Profile] = {p: given[p] for p in request.precisions}
        base = profs.get("fp32", next(iter(profs.values())))
        create_optimizer_state(request.model, request.optimizer)
        budget_bytes = request.budget_bytes(base.measured_peak_bytes)
        baseline = (base.measured_peak_bytes, base.step_seconds)
        return Measured(profs, baseline, budget_bytes, ("planned from the profiles given",))
    found = _profiles(request, complete=isinstance(given, dict))
    if isinstance(given, dict):
        # Only profiles with every mode measured can serve a tighter budget later.
        given.update({p: pr for p, pr in found.profiles.items() if complete_profile(pr)})
    return found


def _refuse_fixed(request: Request, budget_bytes: int, estimated: int = 0) -> None:
    """Refuse a budget under the weights, gradients and optimizer state (levers shrink those)."""
    fixed = fixed_bytes(request.model, request.optimizer)
    if budget_bytes < fixed and not request.levers:
        opt = request.optimizer
        name = type(opt).__name__ if opt is not None else "none"
        detail = ""
        if estimated:
            budget_bytes = request.budget.resolve(estimated)
            detail = f" ({request.budget} of the fp32 peak, estimated at {format_bytes(estimated)})"
        raise InfeasibleBudget(fixed_bytes_message(fixed, budget_bytes, name, detail), fixed, budget_bytes)


def _profilers(request: Request, heads: dict[str, HeadFacts]) -> tuple[dict[str, Profiler], Profiler]:
    """A profiler per precision of the request, and the fp32 one the baseline comes from; the
    loss head's facts measured to time with it in chunks go into ``heads``."""

    def profiler(p: str) -> Profiler:
        precision = Precision(p, device=request.device)  # type: ignore[arg-type]
        r = request
        prof = Profiler(r.model, r.batch, r.loss_fn, r.optimizer, precision, blocks=r.blocks)
        prof.within = r.steps_within
        prof.twin_memory = True  # See Note [one measuring path] in memfit/measuring/twin.py
        # See Note [timing with a lever] in memfit/measuring/timing_lever.py
        if CHUNKED_LOSS.name in r.levers:
            prof.lean = partial(_chunked_head, r, p, heads)
        return prof

    profilers: dict[str, Profiler] = {p: profiler(p) for p in request.precisions}
    return profilers, profilers.get("fp32") or profiler("fp32")


def _chunked_head(request: Request, precision: str, heads: dict[str, HeadFacts]) -> TimingLever | None:
    """The loss head in chunks, to time steps with (None: the lever cannot run on this step);
    its facts kept in ``heads``."""
    model = request.model
    facts = head_facts(model, request.batch, request.loss_fn, precision)
    if facts is None or facts.refused:
        return None
    heads[precision] = facts

    def predict(prof: Profile) -> Profile:
        return with_levers(replace(prof, lever_facts=LeverFacts(head=facts)), [CHUNKED_LOSS.name])

    # the head's gradient matmuls (input, and weight where it trains) run in its forward
    matmul = 2.0 * facts.tokens * facts.hidden * facts.vocab
    moved = matmul * (2 if facts.weight_grad_bytes else 1)
    what = f"the loss head in chunks of {facts.chunk_tokens:,} tokens"
    return TimingLever(CHUNKED_LOSS.name, what, predict, partial(chunked_head_on, model), moved)


def _profiles(request: Request, complete: bool) -> Measured:
    create_optimizer_state(request.model, request.optimizer)
    if request.budget.bytes is not None:
        _refuse_fixed(request, request.budget.bytes)
    heads: dict[str, HeadFacts] = {}
    profilers, base = _profilers(request, heads)
    if request.budget.is_fraction:
        estimate = base.estimated_peak() if request.room is not None else None
        estimate = estimate if estimate is not None else quick_peak(base)
        # Note [refusing on the estimate]
        # A fractional budget is refused on the estimated peak only with a 5% margin; a
        # budget nearer than that is decided by the measured peak.
        if estimate is not None:
            _refuse_fixed(request, request.budget.resolve(int(estimate * 1.05)), estimated=estimate)
    peak = base.none().peak
    budget_bytes = request.budget_bytes(peak)
    _refuse_fixed(request, budget_bytes)
    done: dict[str, Profile] = {}
    for p, prof in profilers.items():
        if not prof.memory:
            prof.none()
        prof.time(_TIMED_STEPS)
        done[p] = prof.result()
    # the fp32 step time is the baseline only when fp32 was timed (it is a candidate)
    baseline = (peak, done["fp32"].step_seconds if "fp32" in done else 0.0)
    lines = [] if "fp32" in profilers else list(base.measured)
    _checkpointed(profilers, done, budget_bytes, complete)
    for prof in profilers.values():
        lines += prof.measured
    return Measured({p: done[p] for p in request.precisions}, baseline, budget_bytes, tuple(lines), heads)


def _checkpointed(
    profilers: Mapping[str, Profiler], done: dict[str, Profile], budget_bytes: int, complete: bool
) -> None:
    """Every mode measured and more rounds timed for the precisions whose plain step does not fit
    (all of them when ``complete``), fastest first; a precision's plans are never faster than its
    step without checkpointing, so once a plan is known that fast, its modes cannot matter."""
    best: float | None = None
    for p in sorted(profilers, key=lambda q: done[q].step_seconds):
        if best is not None and best <= done[p].step_seconds * (1 - TIE):
            continue
        tight = simulate(done[p], "none").peak_bytes > budget_bytes
        if (tight or complete) and profilers[p].blocks:
            profilers[p].modes([m for m in CHECKPOINT_MODES if m != "none"])
            profilers[p].time_checkpointed(_MORE_TIMED_STEPS)
            done[p] = profilers[p].result()
        try:
            found = plan_from_profiles({p: done[p]}, budget_bytes)
        except InfeasibleBudget:
            continue
        seconds = found.report.predicted_step_seconds
        best = seconds if best is None else min(best, seconds)
