"""bf16 autocast: fp32's range, half the bytes of most activations, no loss scaling."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from memfit.devices import DeviceFacts
from memfit.precision.kind import PrecisionKind

__all__ = ["BF16"]


class _Bf16(PrecisionKind):
    name = "bf16"
    dtype = torch.bfloat16
    lightning = "bf16-mixed"
    accelerate = "bf16"
    transformers_flag = "bf16"
    chosen_because = "{device} computes bf16 natively"

    def refusal(self, facts: DeviceFacts) -> str | None:
        if facts.bf16_runs:
            return None
        return (
            f"{facts.description} ({facts.name}) cannot run bf16; use 'fp16' (with loss scaling) or 'fp32'."
        )

    def native(self, facts: DeviceFacts) -> bool:
        return facts.bf16_native

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(device_type, dtype=self.dtype)


BF16 = _Bf16()
