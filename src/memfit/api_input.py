"""What the Python API refuses before any work: batches, optimizers and micro-batches that
cannot train this model, each as one sentence (a :class:`memfit.errors.ConfigError`).

``memfit.plan`` calls :func:`check_plan_inputs` first; ``memfit.train_step`` and the Trainer's
steps call :func:`check_micro_batches`. Both are cheap: they look at shapes and object ids.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 1)
    >>> check_plan_inputs(model, torch.zeros(0, 4), None)
    Traceback (most recent call last):
    ...
    memfit.errors.ConfigError: the batch has no rows (its first dimension is 0); give at least one example.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError

__all__ = ["batch_rows", "check_micro_batches", "check_plan_inputs"]


def batch_rows(batch: Any) -> int:
    """The batch's first dimension (every tensor's, which must agree).

    Raises:
        ConfigError: ``batch`` is not a tensor or a tuple (or list) of tensors with a first
            dimension they share.
    """
    tensors = [batch] if isinstance(batch, torch.Tensor) else batch
    if (
        not isinstance(tensors, tuple | list)
        or not tensors
        or not all(isinstance(t, torch.Tensor) for t in tensors)
    ):
        raise ConfigError(
            f"a batch must be a tensor or a tuple of tensors, got {type(batch).__name__}; "
            "pass e.g. (inputs, targets)."
        )
    if any(t.ndim == 0 for t in tensors):
        raise ConfigError("the batch holds a 0-dimensional tensor; its first dimension must be the batch.")
    rows = {int(t.shape[0]) for t in tensors}
    if len(rows) > 1:
        raise ConfigError(f"the batch's tensors disagree on the batch size ({sorted(rows)}); give them one.")
    return rows.pop()


def check_plan_inputs(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer | None) -> None:
    """Refuse a batch without rows and an optimizer that trains another model's parameters.

    Raises:
        ConfigError: one sentence naming the fix.
    """
    if batch_rows(batch) == 0:
        raise ConfigError("the batch has no rows (its first dimension is 0); give at least one example.")
    if optimizer is None:
        return
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        raise ConfigError(
            f"the optimizer trains {foreign} tensor(s) that are not parameters of this "
            f"{type(model).__name__}; pass the optimizer built from model.parameters()."
        )


def check_micro_batches(batch: Any, micro_batches: int) -> None:
    """Refuse more micro-batches than the batch has rows (some would be empty).

    Raises:
        ConfigError: one sentence naming the fix.
    """
    rows = batch_rows(batch)
    if micro_batches > rows:
        raise ConfigError(
            f"{micro_batches} micro-batches cannot split a batch of {rows}; use at most {rows} "
            "micro-batches, or a larger batch."
        )
