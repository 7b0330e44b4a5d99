"""One training step, the same code for measuring, profiling, benchmarking and training.

``zero_grad(set_to_none=True)``, forward under autocast, scaled backward per micro-batch,
optional clipping (after unscaling), optimizer step through the scaler, scaler update: each
through the :class:`~memfit.precision.Precision` (its kind's ``autocast``, ``backward``,
``optimizer_step``). The fp32 path runs the same lines: autocast is a ``nullcontext`` and the
scaler is disabled (nanoGPT's one code path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from memfit.checkpointing.compile import compiling_step
from memfit.errors import ConfigError
from memfit.levers.fused import fused_step_of
from memfit.precision import Precision

__all__ = [
    "Batch",
    "LossFn",
    "StepResult",
    "batch_size",
    "batch_tokens",
    "split_batch",
    "training_step",
]

Batch = Any
LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class StepResult:
    """What one step did."""

    loss: float
    grad_norm: float | None
    skipped: bool
    scale: float
    samples: int = 0
    """Examples in the batch (its first dimension)."""
    tokens: int = 0
    """Tokens in the batch (see :func:`batch_tokens`)."""


def _tensors(batch: Batch) -> Sequence[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, tuple | list) and all(isinstance(t, torch.Tensor) for t in batch):
        return list(batch)
    raise TypeError("a batch must be a tensor or a tuple of tensors")


def _value(loss: torch.Tensor) -> float:
    """The loss as a float; NaN for fake or meta tensors, which hold no values."""
    if isinstance(loss, FakeTensor) or loss.device.type == "meta":
        return float("nan")
    return float(loss.detach())


def _scalar_loss(loss: Any) -> torch.Tensor:
    """``loss`` if it is a one-element tensor a backward can start from; else one sentence."""
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            f"loss_fn returned {type(loss).__name__} {_short(loss)}, not a tensor; return the loss as a "
            "scalar tensor computed from the model's output (e.g. torch.nn.functional.cross_entropy(...))."
        )
    if loss.numel() != 1:
        raise ConfigError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}, not a scalar; reduce it (e.g. .mean())."
        )
    if not loss.requires_grad:
        raise ConfigError(
            "loss_fn returned a tensor that does not depend on the model's parameters (no grad_fn); "
            "compute it from the model's output, outside torch.no_grad()."
        )
    return loss


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def batch_size(batch: Batch) -> int:
    """The first dimension of the batch's tensors."""
    return int(_tensors(batch)[0].shape[0])


def batch_tokens(batch: Batch) -> int:
    """Tokens in a batch: all elements of its first tensor when that holds integer token ids
    with a sequence dimension, else one per example (images, feature vectors)."""
    first = _tensors(batch)[0]
    if first.ndim >= 2 and not first.is_floating_point() and not first.is_complex():
        return int(first.numel())
    return int(first.shape[0])


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """Split a batch along dimension 0 into ``parts`` micro-batches."""
    if parts == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        return list(batch.chunk(parts))
    chunks = [t.chunk(parts) for t in _tensors(batch)]
    return [type(batch)(c[i] for c in chunks) for i in range(len(chunks[0]))]


def training_step(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision,
    micro_batches: int = 1,
    clip_norm: float | None = None,
    after_forward: Callable[[], None] | None = None,
    after_backward: Callable[[], None] | None = None,
) -> StepResult:
    """Run one step; the loss is the batch mean however many micro-batches it is split into.

    ``after_forward`` is called once, when the first micro-batch's loss is ready (measuring
    uses it to read the memory the forward pass keeps). ``after_backward`` is called once,
    after the last backward and before clipping and the optimizer step (profiling uses it
    to split the step into phases). Under fake tensors (estimating) the loss has no value:
    ``StepResult.loss`` is then NaN.

    With the optimizer step fused into the backward (:class:`memfit.levers.fused.FusedStep`
    installed for ``optimizer``) the last micro-batch's backward steps every parameter
    (clipping included) and nothing is left to do after it.
    """
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
    parts = split_batch(batch, micro_batches)
    total = batch_size(batch)
    loss_sum = 0.0
    fused = fused_step_of(optimizer)
    grad_norm = None
    with compiling_step(model):  # the first step of a compiled model compiles: it says so
        for i, part in enumerate(parts):
            with precision.autocast():
                loss = _scalar_loss(loss_fn(model, part))
            if i == 0 and after_forward is not None:
                after_forward()
            weight = batch_size(part) / total
            share = loss * weight if len(parts) > 1 else loss
            if fused is not None and i == len(parts) - 1:
                grad_norm = fused.backward(precision.scaler.scale(share), clip_norm)
            else:
                precision.backward(share)
            loss_sum += _value(loss) * weight
    if after_backward is not None:
        after_backward()
    if fused is not None:
        return StepResult(loss_sum, grad_norm, False, 1.0, total, batch_tokens(batch))
    scaler = precision.scaler
    if clip_norm is not None and optimizer is not None:
        scaler.unscale_(optimizer)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm))
    scale = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
    skipped = precision.optimizer_step(optimizer) if optimizer is not None else False
    return StepResult(
        loss=loss_sum,
        grad_norm=grad_norm,
        skipped=skipped,
        scale=scale,
        samples=total,
        tokens=batch_tokens(batch),
    )
