"""``memfit.apply``: the one call that changes a model (and its optimizer) the way a
:class:`memfit.Plan` says, and :func:`applied`, the same code undone after its body.

A plan is plain data (``memfit.plan`` decides, ``Plan.from_json`` reads one back). Applying
it checks once that it fits (:func:`~memfit.applying.fits.check_plan_fits`: the model, the
device, the levers), then, like torchtitan's ``apply_ac`` dispatching from one config:
each block's checkpointing and the segments, then every lever in its order (each lever's
:meth:`~memfit.applying.lever.Lever.apply`), then the precision (autocast, the loss scaler,
the modules kept in fp32). It returns what to train with. ``memfit.prepare`` is this call
plus registering the plan for ``memfit.train_step``; the planner measures a candidate plan
inside :func:`applied`, which undoes every change when its body ends.

Trade-off: a plan made for another model is refused with what differs rather than applied
to whatever matches, so a stale plan.json never silently leaves blocks unplanned.

Example:
    >>> from torch import nn
    >>> from memfit.checkpointing import checkpointed_blocks
    >>> from memfit.records import Plan
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    >>> done = apply(model, Plan(blocks={"0": "full", "1": "none"}))
    >>> done.model is model, checkpointed_blocks(model), done.precision.mode
    (True, {'0': 'full'}, 'fp32')
    >>> with applied(model, Plan(blocks={"1": "selective"})):
    ...     checkpointed_blocks(model)
    {'1': 'selective'}
    >>> checkpointed_blocks(model)
    {'0': 'full'}
"""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch
from torch import nn

from memfit.applying.fits import check_plan_fits
from memfit.applying.lever import Applying, Undo
from memfit.applying.registry import REGISTRY, lever, levers_in_order, optimizer_lever
from memfit.checkpointing import checkpointed_blocks, set_block_modes, uncheckpoint
from memfit.checkpointing.segments import applied_segments, set_segments
from memfit.devices import model_device, unwrap
from memfit.errors import ConfigError
from memfit.measuring.preserve import create_optimizer_state
from memfit.precision import Precision
from memfit.records import Plan
from memfit.vocab import CheckpointMode

__all__ = ["Applied", "applied", "apply", "remove_levers"]


class Applied(NamedTuple):
    """What to train with once a plan is applied."""

    model: nn.Module
    """The model (the same object: it is changed in place)."""
    optimizer: torch.optim.Optimizer | None
    """The optimizer to train with: a new one (torchao's AdamW, same param groups and
    hyper-parameters) when a lever keeps the optimizer state or the weights in lower precision,
    else the one given."""
    precision: Precision
    """The plan's precision: its autocast context and loss scaler."""


def apply(
    model: nn.Module,
    plan: Plan,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    precision: Precision | None = None,
    fp32_modules: Iterable[str | type[nn.Module]] = (),
    on_device: bool = True,
) -> Applied:
    """Apply ``plan`` to ``model`` (and ``optimizer``) in place: checkpointing, levers, precision.

    Checkpointing the plan does not name is removed; levers of an earlier plan this one does
    not use are taken off (bf16 and NF4 weights stay). Micro-batches are run by the step
    (:func:`memfit.train_step`, :class:`memfit.Trainer`), not stored in the model.

    Args:
        model: the model the plan was made for (or its DDP / FSDP2 wrapper).
        plan: a :class:`memfit.Plan` (e.g. from :func:`memfit.plan` or ``Plan.from_json``).
        optimizer: its optimizer; needed when a lever changes it (the state levers,
            ``weights_bf16``, ``fused_step``).
        precision: run with this :class:`memfit.Precision` (its fp32-kept modules, its
            scaler) instead of a new one; its mode must be the plan's.
        fp32_modules: with a new Precision, the modules it keeps in fp32.
        on_device: the model is on the device it trains on (False: it is moved later, as
            Lightning does; the plan's device is then not checked).

    Returns:
        :class:`Applied`: ``(model, optimizer, precision)`` to train with.

    Raises:
        ConfigError: the plan does not fit the model (blocks it lacks, made for another model or
            device), ``precision`` contradicts it, or a lever needs the optimizer not given.
        LeverRefused: a lever of the plan cannot run here (the message says why).
    """
    inner = unwrap(model)
    check_plan_fits(inner, plan, optimizer, on_device=on_device)
    precision = _precision(model, plan, precision, fp32_modules)
    _checkpointing(inner, plan)
    optimizer = _levers(inner, plan, optimizer, None)
    return Applied(model, optimizer, precision)


@contextlib.contextmanager
def applied(
    model: nn.Module, plan: Plan, optimizer: torch.optim.Optimizer | None = None
) -> Iterator[Applied]:
    """Run the body with ``plan`` applied as :func:`apply` does, and undo it afterwards.

    What the planner measures a candidate in. With levers, they act on a stateless copy of
    ``optimizer`` (the user's optimizer and its state are left alone;
    See Note [a fresh optimizer for state levers]), whose state is created before the body;
    the weights' dtype, the hooks and the checkpointing are as before afterwards.
    """
    inner = unwrap(model)
    check_plan_fits(inner, plan, optimizer)
    undo = Undo()
    modes, segments = checkpointed_blocks(inner), applied_segments(inner)
    undo.add(lambda: _restore_checkpointing(inner, modes, segments))
    try:
        _checkpointing(inner, plan)
        used = _stateless(optimizer) if plan.levers and optimizer is not None else optimizer
        used = _levers(inner, plan, used, undo)
        if used is not optimizer:
            create_optimizer_state(inner, used)
        yield Applied(model, used, Precision(plan.precision, device=model_device(model)))
    finally:
        undo.run()


def remove_levers(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Take off the hooks and layers a plan's levers installed (the fused step's hooks, the
    chunked head, offloading); the weights' dtype stays."""
    for known in REGISTRY.values():
        known.clear(unwrap(model), optimizer)


def _stateless(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    # Note [a fresh optimizer for state levers]
    # A state lever makes a new optimizer from one without state: a shallow copy whose state
    # is empty, so the user's optimizer and its state are left alone.
    fresh = copy.copy(optimizer)
    fresh.state = collections.defaultdict(dict)
    fresh.param_groups = [dict(g) for g in optimizer.param_groups]
    return fresh


def _planned_modes(plan: Plan) -> dict[str, CheckpointMode]:
    return {n: m for n, m in plan.blocks.items() if m != "none"}


def _checkpointing(model: nn.Module, plan: Plan) -> None:
    """Each block's mode and the segments; left alone when the model is checkpointed so already
    (e.g. by ``memfit.apply`` before a DDP or FSDP2 wrapper)."""
    segments = [list(seg) for seg in plan.segments]
    if checkpointed_blocks(model) == _planned_modes(plan) and applied_segments(model) == segments:
        return
    uncheckpoint(model)
    inside = {n for seg in segments for n in seg}
    set_block_modes(model, {n: m for n, m in plan.blocks.items() if n not in inside})
    set_segments(model, segments)


def _restore_checkpointing(
    model: nn.Module, modes: dict[str, CheckpointMode], segments: list[list[str]]
) -> None:
    uncheckpoint(model)
    inside = {n for seg in segments for n in seg}
    set_block_modes(model, {n: m for n, m in modes.items() if n not in inside})
    set_segments(model, segments)


def _levers(
    model: nn.Module, plan: Plan, optimizer: torch.optim.Optimizer | None, undo: Undo | None
) -> torch.optim.Optimizer | None:
    """Every lever of ``plan`` applied in its order, after taking off what an earlier plan's
    levers installed (for good: ``undo`` None); returns the optimizer to train with."""
    if undo is None or plan.levers:
        remove_levers(model, optimizer)
    by = optimizer_lever(plan.levers)
    ctx = Applying(
        model=model,
        plan=plan,
        undo=undo,
        optimizer_kind=(lever(by).optimizer_kind or "orig") if by else "orig",
        optimizer_lever=by,
        bf16_weights=any(lever(n).bf16_weights for n in plan.levers),
    )
    for each in levers_in_order(plan.levers):
        optimizer = each.apply(optimizer, ctx)
    return optimizer


def _precision(
    model: nn.Module,
    plan: Plan,
    precision: Precision | None,
    fp32_modules: Iterable[str | type[nn.Module]],
) -> Precision:
    if precision is None:
        precision = Precision(plan.precision, device=model_device(model), fp32_modules=fp32_modules)
    elif precision.mode != plan.precision:
        raise ConfigError(
            f"precision {precision.mode!r} contradicts the plan's {plan.precision!r}; pass one of them."
        )
    precision.kind.convert_module(unwrap(model))  # under autocast: the weights stay as they are
    if precision.fp32_modules:
        precision.attach(model)
    return precision
