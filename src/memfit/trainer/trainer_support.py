"""Small helpers of the Trainer: devices, batches, the plan check and the progress line.

Example:
    >>> import torch
    >>> to_device((torch.zeros(2), torch.ones(2)), torch.device("cpu"))[1].tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.precision import Precision
from memfit.records import Plan, StepMetrics
from memfit.step import Batch

__all__ = ["TrainerCallback", "check_plan_applied", "model_device", "progress_postfix", "to_device"]


class TrainerCallback(Protocol):
    """The hooks the Trainer calls; :class:`memfit.trainer.callbacks.Callback` implements them all.

    # NOTE: a Protocol, so the Trainer need not import the callbacks module (which refers to
    # the Trainer): the import graph stays a tree.
    """

    def on_fit_start(self, trainer: Any) -> None:
        """When :meth:`Trainer.fit` starts."""

    def on_step_end(self, trainer: Any, metrics: StepMetrics) -> None:
        """After every step."""

    def on_fit_end(self, trainer: Any) -> None:
        """When :meth:`Trainer.fit` ends."""

    def save_last_good(self, trainer: Any) -> Path | None:
        """Write the state before a step that cannot go on; return where, or None."""


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (the CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch (a tensor, or a tuple or list of them) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(t, device) for t in batch)
    return batch


def progress_postfix(m: StepMetrics, scaled: bool) -> str:
    """The progress bar's text after a step: loss, speed, and the fp16 loss scale."""
    text = f"loss {m.loss:.4f}  {m.tokens_per_s:,.0f} tok/s"
    if scaled:
        text += f"  scale {m.scale:g}" + ("  skipped" if m.skipped else "")
    return text


def check_plan_applied(
    model: nn.Module, plan: Plan, precision: str | Precision | None, micro_batches: int | None
) -> None:
    """Refuse arguments that contradict ``plan`` (the Trainer applies the plan itself, with
    :func:`memfit.prepare`).

    Raises:
        ConfigError: naming the contradiction and the fix.
    """
    asked = precision.mode if isinstance(precision, Precision) else precision
    if asked is not None and asked != plan.precision:
        raise ConfigError(
            f"precision {asked!r} contradicts the plan's {plan.precision!r}; pass one of them, not both."
        )
    if micro_batches is not None and micro_batches != plan.micro_batches:
        raise ConfigError(
            f"micro_batches={micro_batches} contradicts the plan's {plan.micro_batches}; pass one of them."
        )
