"""Whether a plan fits a model, a batch and a device: the one validation before a plan is applied.

A plan the planner made records what it was made for (:class:`memfit.records.MadeFor`: the
model's parameter names and shapes, the batch's shape, the device type); applying it to
another is refused in one sentence rather than applied to whatever matches, so a stale
plan.json never silently leaves blocks unplanned or runs a budget made for another batch.

Example:
    >>> from torch import nn
    >>> from memfit.records import Plan
    >>> a, b = nn.Linear(4, 4), nn.Linear(4, 8)
    >>> plan = Plan(blocks={}, made_for=made_for(a, torch.zeros(2, 4)))
    >>> check_made_for(plan, model=a, batch=torch.zeros(2, 4))
    >>> try:
    ...     check_made_for(plan, model=b)
    ... except ConfigError as exc:
    ...     print(str(exc)[:66])
    the plan was made for another model: Linear with 20 parameters, th
"""

from __future__ import annotations

import difflib
import hashlib
from typing import Any

import torch
from torch import nn

from memfit.applying.registry import check_levers, lever, site_of
from memfit.checkpointing import find_blocks
from memfit.devices import unwrap
from memfit.errors import ConfigError, MemfitError
from memfit.records import MadeFor, Plan
from memfit.vocab import PRECISIONS, normalize_modes

__all__ = ["batch_shapes", "check_made_for", "check_plan_fits", "made_for", "parameters_digest"]


def parameters_digest(model: nn.Module) -> tuple[str, int]:
    """A digest of ``model``'s parameter names and shapes (not dtypes: levers change those),
    and how many values they hold."""
    digest = hashlib.sha256()
    count = 0
    for name, p in unwrap(model).named_parameters():
        digest.update(f"{name}:{tuple(p.shape)};".encode())
        count += p.numel()
    return digest.hexdigest()[:16], count


def batch_shapes(batch: Any) -> list[list[int]]:
    """The shape of each tensor of a batch (a tensor or a tuple of them)."""
    tensors = [batch] if isinstance(batch, torch.Tensor) else list(batch)
    return [list(t.shape) for t in tensors if isinstance(t, torch.Tensor)]


def made_for(model: nn.Module, batch: Any, device: str | torch.device | None = None) -> MadeFor:
    """What a plan made now for ``model`` on ``batch`` is made for."""
    digest, count = parameters_digest(model)
    where = torch.device(device) if device is not None else next(unwrap(model).parameters()).device
    return MadeFor(type(unwrap(model)).__name__, digest, count, batch_shapes(batch), where.type)


def check_made_for(
    plan: Plan, *, model: nn.Module | None = None, batch: Any = None, device: str | torch.device | None = None
) -> None:
    """Refuse, in one sentence, a plan made for another model, batch or device (a plan without
    :attr:`~memfit.records.Plan.made_for`, written by hand, is not checked).

    Raises:
        ConfigError: naming what differs and what to do.
    """
    was = plan.made_for
    if was is None:
        return
    if model is not None and was.parameters:
        digest, count = parameters_digest(model)
        if digest != was.parameters:
            raise ConfigError(
                f"the plan was made for another model: {was.model} with {was.parameter_count:,} parameters, "
                f"this is {type(unwrap(model)).__name__} with {count:,} (other names or shapes); run memfit "
                "plan again for this model."
            )
    if device is not None and was.device and torch.device(device).type != was.device:
        raise ConfigError(
            f"the plan was made on {was.device}, but the model is on {torch.device(device).type}; run "
            "memfit plan again on this device."
        )
    if batch is not None and was.batch and batch_shapes(batch) != was.batch:
        raise ConfigError(
            f"the plan was made for a batch of shape {_shapes(was.batch)}, not "
            f"{_shapes(batch_shapes(batch))}; "
            f"use a batch of {was.batch_rows} rows at the planned sequence length, or run memfit plan again "
            "for this batch."
        )


def _shapes(shapes: list[list[int]]) -> str:
    return ", ".join("x".join(str(d) for d in s) for s in shapes)


def check_plan_fits(
    model: nn.Module,
    plan: Plan,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    levers: bool = True,
    on_device: bool = True,
) -> None:
    """Refuse a plan that does not fit ``model``: unknown blocks, modes, precision or levers, levers
    that cannot run here, a plan made for another model or device, or a planned plan that leaves
    out some of the model's blocks (See Note [plans that name only some blocks]). The one check
    :func:`memfit.apply` runs. ``levers=False``
    leaves the levers to whoever applies them; ``on_device=False``: the model is not yet on the
    device it will train on (Lightning moves it after its ``setup`` hook), so that is not checked.

    Raises:
        ConfigError: one sentence naming what does not fit and what to do.
        LeverRefused: a lever of the plan cannot run here.
    """
    inner = unwrap(model)
    device = next((p.device for p in inner.parameters()), torch.device("cpu"))
    check_made_for(plan, model=inner, device=device if on_device else None)
    _check_blocks(inner, plan)
    if plan.precision not in PRECISIONS:
        raise ConfigError(f"the plan's precision {plan.precision!r} is not one of {', '.join(PRECISIONS)}.")
    for name in plan.levers:
        lever(name).check_settings(plan.lever_settings.get(name, {}))
        if levers and optimizer is None and lever(name).needs_optimizer:
            raise ConfigError(
                f"the plan's lever {name} changes the optimizer: pass it (memfit.apply(model, plan, "
                "optimizer)), or use memfit.prepare."
            )
    if levers:
        check_levers(plan.levers, site_of(device, optimizer, plan.precision, inner))


def _check_blocks(model: nn.Module, plan: Plan) -> None:
    modules = {n for n, _ in model.named_modules() if n}
    named = list(plan.blocks) + [n for seg in plan.segments for n in seg if n not in plan.blocks]
    missing = [n for n in named if n not in modules]
    if missing:
        hints = []
        for name in missing:
            close = difflib.get_close_matches(name, sorted(modules), n=1)
            hints.append(repr(name) + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(
            f"the plan names block(s) {', '.join(hints)} that {type(model).__name__} does not have; "
            "it was made for a different model: run memfit plan again for this one."
        )
    normalize_modes(plan.blocks)
    if plan.blocks and plan.made_for is None and plan.predicted_peak_bytes > 0:
        # Note [plans that name only some blocks]
        # A plan the planner made covers every block it was given; one of an older memfit (it
        # has a prediction but no made_for, whose digest would tell) that covers only some of
        # this model's blocks was made for a smaller model and would leave the rest silently
        # unplanned. A hand-written Plan may name only some blocks.
        try:
            blocks = find_blocks(model)
        except MemfitError:
            blocks = []
        left_out = [b for b in blocks if b not in plan.blocks]
        if left_out and set(plan.blocks) <= set(blocks):
            raise ConfigError(
                f"the plan covers {len(plan.blocks)} of the {len(blocks)} blocks of {type(model).__name__} "
                f"(not {', '.join(repr(b) for b in left_out[:3])}); it was made for a different model: "
                "run memfit plan again for this one."
            )
