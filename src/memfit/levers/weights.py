"""bf16 weights without an fp32 master copy (the ``weights_bf16`` lever).

Every floating parameter's storage is replaced by a bf16 copy in place (``p.data``), so
the parameter objects, and every optimizer holding them, stay the same; buffers (running
statistics, masks) are left as they are. Gradients are then bf16 as well. The updates are
rounded stochastically by the optimizer (:mod:`memfit.levers.optim` says why not Kahan).

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(4, 4)
    >>> saved = cast_weights(lin)
    >>> lin.weight.dtype, weights_dtype(lin)
    (torch.bfloat16, 'bf16')
    >>> restore_weights(saved); lin.weight.dtype
    torch.float32
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["cast_weights", "restore_weights", "weights_dtype"]


def cast_weights(
    model: nn.Module, dtype: torch.dtype = torch.bfloat16
) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Make every floating parameter of ``model`` ``dtype`` in place; returns what to restore.

    Gradients are dropped first (an fp32 gradient cannot accumulate into a bf16 parameter).
    """
    saved = []
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.grad = None
            saved.append((p, p.data))
            p.data = p.data.to(dtype)
    return saved


def restore_weights(saved: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Put back the storages :func:`cast_weights` replaced (their values as they were then)."""
    for p, data in saved:
        p.grad = None
        p.data = data


def weights_dtype(model: nn.Module) -> str:
    """``bf16`` when every floating parameter is bf16, else ``fp32``."""
    floats = [p for p in model.parameters() if p.is_floating_point()]
    return "bf16" if floats and all(p.dtype == torch.bfloat16 for p in floats) else "fp32"
