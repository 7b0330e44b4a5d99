"""The largest batch one plan fits: ``memfit.plan(..., maximize="batch_size")``.

The search (:func:`largest_batch`) looks at the batch size at the given sequence length
(every dimension but the first is kept) for the largest batch that one plan fits into the
budget computed at once, without splitting it into micro-batches (with gradient
accumulation any batch "fits", one sample at a time). Each probe profiles the model at that
batch and asks the exact solver (:mod:`memfit.planning.solver`) whether some per-block
checkpointing fits at some allowed precision; the first guess comes from two profiles
extrapolated linearly (activations grow with the batch, parameters and optimizer state do
not), so a search takes a handful of profiles. The answer is then planned by the function
``memfit.plan`` passes in (its own planner for one batch), measured, and returned with
``Plan.batch_size``.

Each probe measures every mode's memory under fake tensors
(:func:`memfit.measuring.fake_profile.memory_profile`): nothing is allocated, so probing a batch
far larger than the device holds costs a fraction of a step and no memory; a budget larger
than the device has room for is refused before the first probe.

Trade-off: only the answer is planned and measured for real; a model that cannot run on
fake tensors is probed with real steps that fit the device (one that runs out of memory
counts as not fitting).

Example:
    >>> import torch
    >>> import memfit
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> x = torch.randint(0, 256, (2, 16))
    >>> p = memfit.plan(model, (x, x), gpt_loss, "1MiB", precision="fp32", maximize="batch_size")
    >>> p.batch_size > 2 and p.micro_batches == 1 and p.measured_peak_bytes <= p.budget_bytes
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from memfit.budget import format_bytes
from memfit.errors import InfeasibleBudget
from memfit.measuring.fake_profile import memory_profile
from memfit.planning.request import Request
from memfit.planning.solver import minimum_peak, solve
from memfit.records import Plan, Profile
from memfit.step import Batch, batch_size

__all__ = ["PlanAt", "largest_batch", "resize_batch"]

#: ``memfit.plan``'s planner for one batch: ``plan_at(batch, budget_bytes) -> Plan``, raising
#: ``InfeasibleBudget`` (or running out of memory) where nothing fits.
PlanAt = Callable[[Batch, int], Plan]
#: The largest batch a search considers.
_LIMIT = 1 << 20


def resize_batch(batch: Batch, n: int) -> Batch:
    """``batch`` with ``n`` rows (its rows repeated or cut); every other dimension is kept."""
    tensors = [batch] if isinstance(batch, torch.Tensor) else list(batch)
    rows = int(tensors[0].shape[0])
    index = torch.arange(n, device=tensors[0].device) % rows
    out = [t[index] for t in tensors]
    return out[0] if isinstance(batch, torch.Tensor) else type(batch)(out)


def _lerp(a: Any, b: Any, t: float) -> Any:
    """``a + t * (b - a)`` over a profile's JSON tree (bytes rounded up; text kept)."""
    if isinstance(a, bool | str) or a is None:
        return a
    if isinstance(a, int) and isinstance(b, int):
        return max(0, math.ceil(a + t * (b - a)))
    if isinstance(a, float) and isinstance(b, int | float):
        return max(0.0, a + t * (b - a))
    if isinstance(a, dict):
        return {k: _lerp(v, b.get(k, v), t) for k, v in a.items()}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [_lerp(x, y, t) for x, y in zip(a, b, strict=True)]
    return a


def _extrapolated(small: Profile, large: Profile, n: int) -> Profile:
    t = (n - small.batch_size) / (large.batch_size - small.batch_size)
    return replace(Profile.from_dict(_lerp(small.to_dict(), large.to_dict(), t)), batch_size=n)


def _fits(profiles: Mapping[str, Profile], budget: int) -> bool:
    return any(solve(p, budget, 1) is not None for p in profiles.values())


def _guess(small: Mapping[str, Profile], large: Mapping[str, Profile], budget: int, lo: int) -> int:
    """The largest batch two profiles, extrapolated linearly, predict to fit (cheap solves only)."""

    def fits(n: int) -> bool:
        return _fits({k: _extrapolated(small[k], large[k], n) for k in small}, budget)

    hi = max(lo + 1, 2)
    while hi < _LIMIT and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def largest_batch(request: Request, plan_at: PlanAt) -> Plan:
    """The plan for the largest batch (at the request's batch's other dimensions) computed at
    once within its budget.

    A percentage budget is taken of the fp32 no-checkpointing peak at the batch's own size;
    the request's precisions are probed, ``plan_at`` plans the answer for real.
    Returns a :class:`Plan` with ``batch_size`` set and ``micro_batches == 1``; its notes
    say what the next batch size would need.

    Raises:
        InfeasibleBudget: not even a batch of one fits.
    """
    r = request
    cache: dict[int, dict[str, Profile]] = {}

    def profiles_at(n: int) -> dict[str, Profile]:
        if n not in cache:
            sized = resize_batch(r.batch, n)
            blocks = list(r.blocks)
            cache[n] = {
                p: memory_profile(r.model, sized, r.loss_fn, r.optimizer, p, blocks) for p in r.precisions
            }
        return cache[n]

    given = batch_size(r.batch)
    base = profiles_at(given).get("fp32") if r.budget.is_fraction else None
    if r.budget.is_fraction:
        base = base or memory_profile(r.model, r.batch, r.loss_fn, r.optimizer, "fp32", list(r.blocks))
    budget_bytes = r.budget_bytes(base.measured_peak_bytes if base is not None else 0)
    verdicts: dict[int, bool] = {}

    def fits(n: int) -> bool:
        if n not in verdicts:
            try:
                verdicts[n] = _fits(profiles_at(n), budget_bytes)
            except torch.OutOfMemoryError:
                verdicts[n] = False
        return verdicts[n]

    order: list[int] = []
    if fits(given):
        lo, hi = (2 * given, _LIMIT) if fits(2 * given) else (given, 2 * given)
        if 2 * given in cache:
            guess = _guess(profiles_at(given), profiles_at(2 * given), budget_bytes, lo)
            order = [guess, guess + 1]
    else:
        lo, hi = 0, given
    lo, hi = _bracket(fits, lo, hi, order)
    reasons: list[str] = []
    while True:
        if lo < 1:
            _refuse(profiles_at(1), budget_bytes, reasons)
        result = _plan_at(plan_at, r.batch, budget_bytes, lo, reasons)
        if result is not None:
            break
        # Predicted to fit but measured over (or only with micro-batches): go lower.
        lo, hi = _bracket(fits, 0, lo, [lo - 1])
    notes = list(result.notes)
    if hi in cache:
        least = min(minimum_peak(p, 1).peak_bytes for p in profiles_at(hi).values())
        why = (
            f"needs at least {format_bytes(least)} (predicted)"
            if least > budget_bytes
            else "was measured over the budget"
        )
        notes.append(f"largest batch computed at once: {lo}; a batch of {hi} {why}")
    return replace(result, batch_size=lo, report=replace(result.report, notes=notes))


def _bracket(fits: Callable[[int], bool], lo: int, hi: int, order: list[int]) -> tuple[int, int]:
    """Narrow ``lo`` (fits) .. ``hi`` (does not) to neighbours, probing ``order`` first, then halves."""
    for n in order:
        if lo < n < hi:
            lo, hi = (n, hi) if fits(n) else (lo, n)
    while hi == _LIMIT and lo < _LIMIT:  # no upper bound yet: double
        nxt = min(2 * lo, _LIMIT)
        if nxt == _LIMIT or not fits(nxt):
            hi = nxt
        else:
            lo = nxt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, hi


def _plan_at(plan_at: PlanAt, batch: Batch, budget_bytes: int, n: int, why: list[str]) -> Plan | None:
    """The planner's plan at batch ``n``, or None if it needs micro-batches once measured
    (``why`` then receives the planner's reason, if it refused)."""
    # The probes measure memory only (fake tensors, no times); the answer is profiled again
    # with the usual timed steps, so that the planner chooses between fitting plans by their
    # times, and measured for real.
    try:
        result = plan_at(resize_batch(batch, n), budget_bytes)
    except (InfeasibleBudget, torch.OutOfMemoryError) as exc:
        why[:] = [str(exc).rstrip(".")]
        return None
    return result if result.micro_batches == 1 else None


def _refuse(profiles: Mapping[str, Profile], budget_bytes: int, why: Sequence[str] = ()) -> None:
    least = min(minimum_peak(p, 1).peak_bytes for p in profiles.values())
    if least <= budget_bytes and why:
        raise InfeasibleBudget(
            f"a batch of one is predicted to fit the budget of {format_bytes(budget_bytes)} (its smallest "
            f"peak is {format_bytes(least)}) but could not be planned here: {why[-1]}.",
            minimum_bytes=least,
            budget_bytes=budget_bytes,
        )
    raise InfeasibleBudget(
        f"not even a batch of one fits the budget of {format_bytes(budget_bytes)}: its smallest "
        f"predicted peak is {format_bytes(least)}; raise the budget or shorten the sequence.",
        minimum_bytes=least,
        budget_bytes=budget_bytes,
    )
