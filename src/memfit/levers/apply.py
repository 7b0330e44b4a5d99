"""Apply a plan's levers to a model and its optimizer (``memfit.prepare`` calls this).

Example:
    >>> import torch
    >>> from memfit.records import Plan
    >>> lin = torch.nn.Linear(4, 4)
    >>> opt = apply_levers(lin, torch.optim.AdamW(lin.parameters()), Plan(blocks={}, levers=["fused_step"]))
    >>> type(opt).__name__, fused_step_of(opt) is not None
    ('AdamW', True)
    >>> remove_levers(lin, opt)
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.devices import model_device
from memfit.levers.frozen import FrozenSaved, cast_frozen, quantize_frozen
from memfit.levers.fused import FusedStep, fused_step_of
from memfit.levers.head import install_chunked_head, remove_chunked_head
from memfit.levers.offload import clear_offload, offload_blocks
from memfit.levers.optim import is_lever_optimizer, lever_optimizer
from memfit.levers.spec import check_levers, state_kind
from memfit.levers.weights import cast_weights
from memfit.records import Plan

__all__ = ["apply_levers", "frozen_levers", "remove_levers"]


def apply_levers(model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan) -> torch.optim.Optimizer:
    """Make ``model`` and ``optimizer`` run ``plan.levers``; returns the optimizer to train with.

    A state lever or ``weights_bf16`` returns a new optimizer (torchao's AdamW, same param
    groups and hyper-parameters); otherwise ``optimizer`` itself. ``weights_bf16`` casts the
    weights in place; ``fused_step`` installs the hooks; ``offload`` wraps ``plan.offload``;
    ``chunked_loss`` makes the model compute its loss in chunks of ``plan.loss_chunk_tokens``
    tokens (0: the default for its vocabulary; :mod:`memfit.levers.head`);
    ``frozen_bf16`` casts the frozen weights to bf16 in place and ``frozen_nf4`` replaces frozen
    Linear weights by NF4 ones, in the optimizer's param groups too (:mod:`memfit.levers.frozen`).
    Levers of an earlier plan that this one does not use are taken off (bf16 and NF4 weights stay).

    Raises:
        LeverRefused: a lever cannot run with this device, optimizer or precision.
    """
    levers = list(plan.levers)
    check_levers(
        levers, device=model_device(model), optimizer=optimizer, precision=plan.precision, model=model
    )
    old = fused_step_of(optimizer)
    if old is not None:
        old.remove()
    kind = state_kind(levers)
    bf16 = "weights_bf16" in levers
    new = optimizer
    if kind != "fp32" or bf16:
        same = is_lever_optimizer(optimizer) and getattr(optimizer, "memfit_state", "") == kind
        if not (same and getattr(optimizer, "bf16_stochastic_round", False) == bf16):
            new = lever_optimizer(optimizer, kind, weights_bf16=bf16)
    if bf16:
        cast_weights(model)
    frozen_levers(model, new, levers)
    clear_offload(model)
    if "offload" in levers:
        offload_blocks(model, plan.offload)
    remove_chunked_head(model)
    if "chunked_loss" in levers:
        install_chunked_head(model, plan.loss_chunk_tokens or None)
    if "fused_step" in levers:
        FusedStep(new)
    return new


def frozen_levers(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    levers: list[str],
    saved: FrozenSaved | None = None,
) -> FrozenSaved:
    """Apply ``frozen_nf4`` then ``frozen_bf16`` of ``levers`` to ``model``; returns what to restore
    (added to ``saved`` when given)."""
    saved = saved if saved is not None else FrozenSaved()
    if "frozen_nf4" in levers:
        quantize_frozen(model, optimizer, saved)
    if "frozen_bf16" in levers:
        cast_frozen(model, saved)
    return saved


def remove_levers(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Take off the hooks and wrappers :func:`apply_levers` installed (the weights' dtype stays)."""
    fused = fused_step_of(optimizer)
    if fused is not None:
        fused.remove()
    clear_offload(model)
    remove_chunked_head(model)
