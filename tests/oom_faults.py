"""Emulated memory limits for out-of-memory tests on a CPU.

:class:`KeptBytesLimit` wraps a loss function so that, while armed, it raises
``torch.OutOfMemoryError`` as soon as the forward pass has kept more than ``limit`` bytes
for backward: a device whose memory is that much smaller. Checkpointed blocks keep only
their inputs (PyTorch's checkpoint packs their internals with its own hooks), and each
micro-batch is counted on its own, so a plan with more checkpointing or more micro-batches
fits where a plan with less does not, as on a real device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class KeptBytesLimit:
    """A loss-function wrapper with an emulated memory limit for kept activations."""

    def __init__(
        self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], limit: float = float("inf")
    ) -> None:
        self.loss_fn = loss_fn
        self.limit = limit
        self.armed = False
        self.failures = 0
        self.last_kept = 0

    def kept_bytes(self, model: nn.Module, batch: Any) -> int:
        """Bytes the forward pass of ``loss_fn`` keeps for backward (not armed, not raising)."""
        armed, self.armed = self.armed, True
        limit, self.limit = self.limit, float("inf")
        try:
            self(model, batch)
        finally:
            self.armed, self.limit = armed, limit
        return self.last_kept

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if not self.armed:
            return self.loss_fn(model, batch)
        kept = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept[0] += t.numel() * t.element_size()
            if kept[0] > self.limit:
                self.failures += 1
                raise torch.OutOfMemoryError(
                    f"emulated: the forward pass keeps {kept[0]} bytes, over the limit of {int(self.limit)}"
                )
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = self.loss_fn(model, batch)
        self.last_kept = kept[0]
        return loss
