"""The learning-rate schedule of memfit's runs: linear warm-up, then cosine decay or constant.

Trade-off: a ``LambdaLR`` over plain step numbers works for any number of steps (PyTorch's
``OneCycleLR`` divides by zero when its warm-up rounds to a single step).

Example:
    >>> import torch
    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    >>> sched = lr_schedule(opt, steps=10, warmup_steps=2)
    >>> [round(sched.lr_lambdas[0](s), 3) for s in (0, 1, 2, 9)]
    [0.5, 1.0, 1.0, 0.134]
"""

from __future__ import annotations

import math

import torch

from memfit.vocab import Schedule

__all__ = ["lr_schedule"]


def lr_schedule(
    optimizer: torch.optim.Optimizer, steps: int, warmup_steps: int = 0, kind: Schedule = "cosine"
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm up linearly over ``warmup_steps``, then decay by cosine to 10% (or stay constant).

    Args:
        optimizer: its learning rates are the peak rates.
        steps: total optimizer steps of the run.
        warmup_steps: steps of linear warm-up (0: none).
        kind: ``"cosine"`` or ``"constant"`` after the warm-up.

    Returns:
        A ``LambdaLR``; call ``.step()`` after each optimizer step.
    """

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "cosine":
            t = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
