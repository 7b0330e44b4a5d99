"""What a precision is: one object that owns how a step runs in it (:class:`PrecisionKind`).

As Lightning Fabric's precision plugins: each precision (:mod:`.fp32`, :mod:`.bf16`,
:mod:`.fp16`) is one small object listed once in :mod:`.registry`, owning its autocast
context, its loss scaler, how a module is converted for it, and the backward and optimizer
step through that scaler; and when a device cannot run it (one sentence). The fp32 path is
the same code (nanoGPT's single path): a ``nullcontext`` autocast and a disabled
``GradScaler`` whose ``scale`` / ``step`` / ``update`` pass straight through.
:class:`memfit.Precision` is one of them made for a device, holding the scaler that lives
across steps.

Example:
    >>> from memfit.precision.registry import precision_kind
    >>> precision_kind("fp16").loss_scaled, precision_kind("bf16").dtype
    (True, torch.bfloat16)
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from memfit.devices import DeviceFacts

__all__ = ["PrecisionKind"]


class PrecisionKind:
    """One precision a step can run in. Subclass it, set the names, and list it in the registry."""

    name: str = ""
    """Its name in :data:`memfit.vocab.PRECISIONS` (plans, configs and the command line spell it so)."""
    dtype: torch.dtype = torch.float32
    """The dtype autocast computes in (fp32: no autocast)."""
    loss_scaled: bool = False
    """The loss is scaled (dynamic loss scaling: fp16's small range needs it)."""
    lightning: str = ""
    """Lightning's ``Trainer(precision=...)`` for it."""
    accelerate: str = ""
    """accelerate's ``Accelerator(mixed_precision=...)`` for it."""
    transformers_flag: str = ""
    """The ``TrainingArguments`` flag that turns it on (``bf16``, ``fp16``; "" for fp32)."""
    memory_as: str = ""
    """The precision whose step memory this one's is (fp16: bf16's;
    See Note [fp16 is bf16's memory] in :mod:`memfit.measuring.estimate`), so an estimate runs it
    once; "" : its own."""
    chosen_because: str = "{device} runs it"
    """Why ``"auto"`` chose it (``.format(device=...)``): the ``reason`` of :class:`memfit.Precision`."""

    def refusal(self, facts: DeviceFacts) -> str | None:
        """Why the device cannot run it (one sentence), or None."""
        return None

    def native(self, facts: DeviceFacts) -> bool:
        """Whether the device computes in it natively (fast), rather than emulating it."""
        return True

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        """The context a forward pass runs in."""
        return contextlib.nullcontext()

    def scaler(self, device_type: str) -> torch.amp.GradScaler:
        """A new loss scaler (disabled unless the loss is scaled)."""
        return torch.amp.GradScaler(device_type, enabled=self.loss_scaled)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """``module`` as it trains in this precision: under autocast the weights stay as they are."""
        return module

    def backward(self, loss: torch.Tensor, scaler: torch.amp.GradScaler) -> torch.Tensor:
        """The backward of ``loss`` through the scaler; returns the scaled loss."""
        scaled = scaler.scale(loss)
        scaled.backward()
        return scaled

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> bool:
        """Step ``optimizer`` through the scaler and update it; returns whether the step was
        skipped (an fp16 step with an overflow lowers the scale instead)."""
        before = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
        scaler.step(optimizer)
        scaler.update()
        return scaler.is_enabled() and float(scaler.get_scale()) < before
