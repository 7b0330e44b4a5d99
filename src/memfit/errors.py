"""User-facing errors.

Every error a user can cause (a bad budget, a bad config, an impossible plan, an
unsupported dtype) is a :class:`MemfitError` whose message is one sentence naming what is
wrong and how to fix it. The CLI prints the message and exits with code 2; library callers
catch the class they care about.
"""

from __future__ import annotations

import torch

__all__ = [
    "CheckpointError",
    "ConfigError",
    "InfeasibleBudget",
    "LeverRefused",
    "MemfitError",
    "NonFiniteLoss",
    "OutOfMemory",
    "StateError",
    "UnsupportedPrecision",
    "UsageError",
    "is_out_of_memory",
    "shown",
]

_OOM_MESSAGES = ("can't allocate memory", "out of memory", "cannot allocate memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation failed (CUDA, MPS or the CPU allocator, or Python).

    Example:
        >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory")), is_out_of_memory(ValueError())
        (True, False)
    """
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MESSAGES)


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` for a message, cut to about ``limit`` characters (a 5,000-character value
    is named by its start, its end and its length, not echoed whole).

    Example:
        >>> print(shown("x" * 5000))
        'xxxxxxxxxxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxxxxxxxxx' (5002 characters)
    """
    text = repr(value)
    if len(text) <= limit:
        return text
    half = max(1, (limit - 8) // 2)
    return f"{text[:half]}...{text[-half:]} ({len(text)} characters)"


class MemfitError(Exception):
    """Base class of errors caused by user input; the message says how to fix it."""


class ConfigError(MemfitError, ValueError):
    """A configuration value, argument or file is invalid."""


class UsageError(ConfigError):
    """The command line cannot be parsed (an unknown option, a missing value)."""


class UnsupportedPrecision(MemfitError, ValueError):
    """A precision mode was asked for that the device cannot run, or that does not exist."""


class InfeasibleBudget(MemfitError):
    """No plan fits the memory budget.

    Attributes:
        minimum_bytes: the smallest predicted peak of any plan memfit could make.
        budget_bytes: the budget that was asked for.
    """

    def __init__(self, message: str, minimum_bytes: int, budget_bytes: int) -> None:
        super().__init__(message)
        self.minimum_bytes = int(minimum_bytes)
        self.budget_bytes = int(budget_bytes)


class NonFiniteLoss(MemfitError):
    """Training stopped because the loss was not finite (inf or NaN).

    Attributes:
        attribution: where the first non-finite value appeared (a
            :class:`memfit.records.NonFinite`: module, phase, dtype), or None.
        state_path: the file holding the last good training state, or None.
    """

    def __init__(
        self, message: str, attribution: object | None = None, state_path: object | None = None
    ) -> None:
        super().__init__(message)
        self.attribution = attribution
        self.state_path = state_path


class CheckpointError(MemfitError, RuntimeError):
    """A checkpointed block's recompute would not reproduce its forward (an input or a kept
    output was written in place after the forward); the message names the block and the mode to use.

    It is also a ``RuntimeError``, as PyTorch's own checkpoint errors are.
    """


class StateError(MemfitError):
    """A training-state file is missing, truncated, damaged or does not fit this run."""


class OutOfMemory(MemfitError, torch.OutOfMemoryError):
    """A training step ran out of memory and could not be re-planned and run again.

    It is also a ``torch.OutOfMemoryError``, so code that catches PyTorch's error catches it.

    Attributes:
        state_path: the file holding the training state from before the step, or None.
    """

    def __init__(self, message: str, state_path: object | None = None) -> None:
        super().__init__(message)
        self.state_path = state_path


class LeverRefused(ConfigError):
    """A lever (:mod:`memfit.levers`) cannot be used in this configuration; the message says why.

    Attributes:
        lever: the lever's name (``fused_step``, ``state_8bit``, ...).
    """

    def __init__(self, message: str, lever: str = "") -> None:
        super().__init__(message)
        self.lever = lever
