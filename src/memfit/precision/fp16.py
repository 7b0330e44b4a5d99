"""fp16 autocast with dynamic loss scaling (``GradScaler``): its range is small (largest value
65504), so the loss is scaled up before the backward and the gradients checked for overflow
before the optimizer steps (a step with one is skipped and the scale lowered)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from memfit.devices import DeviceFacts
from memfit.precision.kind import PrecisionKind

__all__ = ["FP16"]


class _Fp16(PrecisionKind):
    name = "fp16"
    dtype = torch.float16
    loss_scaled = True
    lightning = "16-mixed"
    accelerate = "fp16"
    transformers_flag = "fp16"
    chosen_because = "{device} has fast fp16 but no native bf16"
    memory_as = "bf16"

    def refusal(self, facts: DeviceFacts) -> str | None:
        if facts.fp16_runs:
            return None
        return f"{facts.description} ({facts.name}) cannot run fp16; use 'bf16' or 'fp32'."

    def native(self, facts: DeviceFacts) -> bool:
        return facts.fp16_native

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(device_type, dtype=self.dtype)


FP16 = _Fp16()
