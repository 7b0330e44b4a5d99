"""Run a first step on a user's batch and turn a shape mismatch into one clear sentence.

A batch that does not fit the model (wrong sequence length, wrong channels, token ids past
the vocabulary) fails deep inside PyTorch with a traceback; profiling and estimating run
this step first, so the user sees what was wrong with the batch instead.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from memfit.precision import Precision
    >>> m = nn.Linear(4, 2)
    >>> loss = lambda model, b: model(b).sum()
    >>> checked_step(m, torch.zeros(3, 5), loss, None, Precision("fp32"))
    Traceback (most recent call last):
    ...
    memfit.errors.ConfigError: one training step of Linear on the batch (a tensor of shape (3, 5)) failed: ...
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from memfit.errors import ConfigError, MemfitError, is_out_of_memory
from memfit.levers.quiet import held_logs
from memfit.precision import Precision
from memfit.step import Batch, LossFn, StepResult, training_step

__all__ = ["batch_errors", "checked_step", "describe_batch", "fake_logs_held", "tensor_bytes"]


def _tensors(batch: Batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, tuple | list):
        return [t for t in batch if isinstance(t, torch.Tensor)]
    return []


def tensor_bytes(batch: Batch) -> int:
    """Bytes of the batch's tensors."""
    return sum(t.numel() * t.element_size() for t in _tensors(batch))


def describe_batch(batch: Batch) -> str:
    """``a tensor of shape (B, T)`` or ``tensors of shapes (B, T), (B, T)``."""
    shapes = [str(tuple(t.shape)) for t in _tensors(batch)]
    if isinstance(batch, torch.Tensor):
        return f"a tensor of shape {shapes[0]}"
    return f"tensors of shapes {', '.join(shapes)}" if shapes else f"a {type(batch).__name__}"


def checked_step(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision,
) -> StepResult:
    """Run one training step; a failure caused by the batch becomes a :class:`ConfigError`.

    Raises:
        ConfigError: the batch is not a tensor or tuple of tensors, or the step fails on it.
    """
    with batch_errors(model, batch):
        return training_step(model, batch, loss_fn, optimizer, precision)


@contextlib.contextmanager
def batch_errors(model: nn.Module, batch: Batch) -> Iterator[None]:
    """Turn a failure of the body (running the model on ``batch``) into a :class:`ConfigError`."""
    if not _tensors(batch) or (not isinstance(batch, torch.Tensor) and len(_tensors(batch)) != len(batch)):
        raise ConfigError(
            f"the batch must be a tensor or a tuple of tensors, got {type(batch).__name__}; "
            "pass e.g. (inputs, targets)."
        )
    # the batch's failure is said in the sentence below; anything else is shown with its lines
    with fake_logs_held() as held:
        try:
            yield
        except MemfitError:
            raise
        except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as exc:
            if is_out_of_memory(exc):
                _show(held)
                raise  # running out of memory is not the batch's fault; callers re-plan or say so
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"one training step of {type(model).__name__} on the batch ({describe_batch(batch)}) "
                f"failed: {detail.rstrip('.')}; give a batch whose shape and values fit the model "
                "and loss function."
            ) from None
        except BaseException:
            _show(held)
            raise


def fake_logs_held() -> contextlib.AbstractContextManager[list[logging.LogRecord]]:
    """torch's fake-tensor log held back while the body runs: torch 2.15 logs a kernel that fails
    on fake tensors with its traceback before raising the error, which memfit says in one sentence
    (:func:`memfit.levers.quiet.held_logs`; ``memfit -v`` shows it)."""
    return held_logs("torch._subclasses.fake_tensor")


def _show(held: list[logging.LogRecord]) -> None:
    """The lines held back, shown after all (an error that is not the batch's)."""
    for record in held:
        logging.getLogger(record.name).callHandlers(record)  # past the filter that held it
