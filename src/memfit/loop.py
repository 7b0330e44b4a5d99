"""Your own training loop with a plan: ``memfit.prepare`` once, ``memfit.train_step`` per step.

``prepare(model, optimizer, plan)`` is :func:`memfit.apply` (everything the plan decides that
lives in the model or the optimizer: each block's checkpointing, the levers, and the
precision it runs in: autocast, and for fp16 the loss scaler, which must live across steps)
plus registering the plan for :func:`train_step`; the plan is checked there, once.
``train_step(model, batch, loss_fn, optimizer, plan)`` then runs one step exactly as
planned: the batch split into ``plan.micro_batches`` micro-batches under autocast with
gradient accumulation (the effective batch is unchanged), scaled backward, clipping when
asked, the optimizer step through the scaler, and gradients zeroed. :class:`memfit.Trainer`
runs the same two calls. ``compile=True`` (to either) compiles the model in place with
``torch.compile`` after the plan is applied (see :mod:`memfit.checkpointing.compile`).

Trade-off: the step owns ``zero_grad`` and ``optimizer.step()``, so a loop that needs to
act between backward and the optimizer step (gradient surgery, custom clipping) uses
:func:`memfit.step.training_step` with its ``after_backward`` hook instead.

Example:
    >>> import torch, memfit
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> torch.manual_seed(0) and None
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> plan = memfit.Plan(blocks={"blocks.0": "full", "blocks.1": "none"}, micro_batches=2)
    >>> model, opt = memfit.prepare(model, opt, plan)
    >>> x = torch.randint(0, 256, (4, 16))
    >>> losses = [memfit.train_step(model, (x, x), gpt_loss, opt, plan) for _ in range(3)]
    >>> losses[-1] < losses[0]
    True
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from memfit.api_input import check_micro_batches
from memfit.applying import apply
from memfit.checkpointing.compile import compile_in_place
from memfit.devices import unwrap
from memfit.errors import ConfigError, LeverRefused, NonFiniteLoss
from memfit.levers.fused import fused_step_of
from memfit.precision import Precision
from memfit.records import Plan
from memfit.step import Batch, LossFn, StepResult, training_step

__all__ = ["Prepared", "planned_step", "prepare", "prepared", "train_step"]


@dataclass
class Prepared:
    """What :func:`prepare` set up for one optimizer: the plan and the precision it runs in."""

    plan: Plan
    precision: Precision
    """Its autocast context and loss scaler (``.scaler.state_dict()`` to save it)."""
    model: weakref.ref[nn.Module]


# Keyed by the optimizer (weakly): the scaler's state must live from step to step, and the
# optimizer is the one object a loop passes to every step that is its own.
_PREPARED: weakref.WeakKeyDictionary[torch.optim.Optimizer, Prepared] = weakref.WeakKeyDictionary()


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan,
    *,
    precision: Precision | None = None,
    compile: bool = False,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Make ``model`` and ``optimizer`` run ``plan``; returns them (use what it returns).

    :func:`memfit.apply` (per-block checkpointing and segments, left as they are when the
    model is checkpointed so already, e.g. by ``memfit.apply`` before a DDP or FSDP2 wrapper;
    the levers; the precision), then the plan registered for :func:`train_step`. Calling it
    again with another plan replaces the first.

    Args:
        model: the model the plan was made for (or its DDP / FSDP2 wrapper).
        optimizer: its optimizer.
        plan: a :class:`memfit.Plan` (from :func:`memfit.plan` or ``Plan.from_json``).
        precision: run with this :class:`memfit.Precision` object (its fp32-kept modules,
            its scaler) instead of a new one; its mode must be the plan's.
        compile: compile ``model`` in place (``model.compile()``, so ``state_dict`` keys do
            not change) after applying the plan; a model already compiled stays as it is.
            The plan, made eagerly, holds compiled (tests/test_compile.py).

    Returns:
        ``(model, optimizer)``: the model, and the optimizer to train with: a new one
        (torchao's AdamW, same param groups and hyper-parameters) when ``plan.levers``
        keeps the optimizer state or the weights in lower precision, else the same object.

    Raises:
        ConfigError: the plan does not fit the model, or ``precision`` contradicts it.
        LeverRefused: one of ``plan.levers`` cannot run here (the message says why).
    """
    done = apply(model, plan, optimizer, precision=precision)  # the plan is checked here, once
    assert done.optimizer is not None
    registered = Prepared(plan=plan, precision=done.precision, model=weakref.ref(unwrap(model)))
    _PREPARED[done.optimizer] = registered
    if compile:
        compile_in_place(model)
    return model, done.optimizer


def prepared(optimizer: torch.optim.Optimizer) -> Prepared:
    """What :func:`prepare` set up for ``optimizer``.

    Raises:
        ConfigError: ``prepare`` was not called with this optimizer.
    """
    found = _PREPARED.get(optimizer)
    if found is None:
        raise ConfigError(
            "this optimizer was not prepared: call model, optimizer = memfit.prepare(model, optimizer, plan) "
            "once before memfit.train_step."
        )
    return found


def planned_step(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    plan: Plan,
    *,
    clip_norm: float | None = None,
    compile: bool = False,
) -> StepResult:
    """:func:`train_step` with everything the step did (loss, grad norm, scale, skipped)."""
    state = prepared(optimizer)
    if state.plan is not plan and state.plan != plan:
        raise ConfigError(
            "the plan given to train_step is not the one given to memfit.prepare; call "
            "memfit.prepare(model, optimizer, plan) again with this plan."
        )
    if state.model() is not unwrap(model):
        raise ConfigError(
            "train_step got another model than the one prepared with this optimizer; pass the model "
            "memfit.prepare returned."
        )
    if clip_norm is not None and not clip_norm > 0:
        raise ConfigError(f"clip_norm must be positive (or None for no clipping), got {clip_norm!r}.")
    if clip_norm is not None and fused_step_of(optimizer) is not None and "selective" in plan.blocks.values():
        raise LeverRefused(
            "fused_step with clipping runs the backward twice (norms first, then the step), which "
            "selective checkpointing allows once; use full checkpointing there, no clipping, or no "
            "fused_step.",
            "fused_step",
        )
    check_micro_batches(batch, plan.micro_batches)
    if compile:
        compile_in_place(model)
    return training_step(model, batch, loss_fn, optimizer, state.precision, plan.micro_batches, clip_norm)


def _finite(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` that raises :class:`NonFiniteLoss` before the backward of a non-finite loss."""

    def checked(model: nn.Module, batch: Batch) -> torch.Tensor:
        loss = loss_fn(model, batch)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and not torch.isfinite(loss.detach()).all():
            raise NonFiniteLoss(
                f"the loss is {float(loss.detach())}, not finite, so this step was not taken (the weights "
                "are those before it); lower the learning rate, check the data, or pass check_finite=False."
            )
        return loss

    return checked


def train_step(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    plan: Plan,
    *,
    clip_norm: float | None = None,
    compile: bool = False,
    check_finite: bool = True,
) -> float:
    """Run one training step exactly as ``plan`` says and return the batch's mean loss.

    Zeroes the gradients, splits ``batch`` into ``plan.micro_batches`` micro-batches, runs
    each forward under the plan's autocast and its scaled backward (gradients accumulate,
    each micro-batch weighted by its share of the batch), clips the gradient norm to
    ``clip_norm`` when given (after unscaling), and steps the optimizer through the scaler
    (an fp16 step with an overflow is skipped and the scale lowered).

    Args:
        model: the model :func:`prepare` returned.
        batch: a tensor or tuple of tensors whose first dimension is the batch.
        loss_fn: ``loss_fn(model, batch) -> scalar loss tensor`` (the mean over the batch).
        optimizer: the optimizer :func:`prepare` returned.
        plan: the plan given to :func:`prepare`.
        clip_norm: clip the gradient norm to this; None: no clipping.
        compile: compile ``model`` in place before this step unless it runs compiled
            already (as ``memfit.prepare(..., compile=True)`` does).
        check_finite: raise :class:`memfit.NonFiniteLoss` on a loss that is not finite,
            before its backward, as :class:`memfit.Trainer` stops (one host sync per
            micro-batch); False returns the NaN and steps the optimizer anyway.

    Returns:
        The loss of the whole batch as a float (the micro-batches' losses, weighted).

    Raises:
        ConfigError: ``prepare`` was not called for this optimizer, or with another plan, or
            the plan has more micro-batches than the batch has rows.
        NonFiniteLoss: the loss was inf or NaN (with ``check_finite``); the optimizer did not
            step, so the weights and optimizer state are those before this call.
    """
    fn = _finite(loss_fn) if check_finite else loss_fn
    return planned_step(model, batch, fn, optimizer, plan, clip_norm=clip_norm, compile=compile).loss
