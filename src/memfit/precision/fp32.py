"""fp32: no autocast, no loss scaling; every device runs it."""

from __future__ import annotations

import torch

from memfit.precision.kind import PrecisionKind

__all__ = ["FP32"]


class _Fp32(PrecisionKind):
    name = "fp32"
    dtype = torch.float32
    lightning = "32-true"
    accelerate = "no"
    chosen_because = "{device} has no native bf16 or fp16, so fp32 is fastest"


FP32 = _Fp32()
