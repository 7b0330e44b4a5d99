"""User-facing errors.

Every error a user can cause (a bad budget, a bad config, an impossible plan, an
unsupported dtype) is a :class:`MemfitError` whose message is one sentence naming what is
wrong and how to fix it. The CLI prints the message and exits with code 2; library callers
catch the class they care about.

See Note [errors without torch]: importing this module imports no torch.
"""

from __future__ import annotations

import sys
from typing import Any

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

# Note [errors without torch]
# The command line checks a config path, a budget and an output path before it imports
# torch (which takes seconds), and those checks raise these errors, so this module imports
# no torch. The one error that must also be a torch class, OutOfMemory, is made the first
# time it is asked for (PEP 562 module __getattr__), by which time torch is imported anyway.


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation failed (CUDA, MPS or the CPU allocator, or Python).

    Example:
        >>> import torch
        >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory")), is_out_of_memory(ValueError())
        (True, False)
    """
    torch = sys.modules.get("torch")  # an error torch raised means torch is imported
    if isinstance(exc, MemoryError) or (torch is not None and isinstance(exc, torch.OutOfMemoryError)):
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


#: A training step ran out of memory and could not be re-planned and run again; also a
#: ``torch.OutOfMemoryError``. Made on first use: see Note [errors without torch].
OutOfMemory: type[MemfitError]


def _out_of_memory() -> type[MemfitError]:
    import torch

    class OutOfMemory(MemfitError, torch.OutOfMemoryError):
        """A training step ran out of memory and could not be re-planned and run again.

        It is also a ``torch.OutOfMemoryError``, so code that catches PyTorch's error catches it.

        Attributes:
            state_path: the file holding the training state from before the step, or None.
        """

        def __init__(self, message: str, state_path: object | None = None) -> None:
            super().__init__(message)
            self.state_path = state_path

    OutOfMemory.__module__, OutOfMemory.__qualname__ = __name__, "OutOfMemory"
    return OutOfMemory


def __getattr__(name: str) -> Any:
    if name == "OutOfMemory":
        made = globals()["OutOfMemory"] = _out_of_memory()
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class LeverRefused(ConfigError):
    """A lever (:mod:`memfit.levers`) cannot be used in this configuration; the message says why.

    Attributes:
        lever: the lever's name (``fused_step``, ``state_8bit``, ...).
    """

    def __init__(self, message: str, lever: str = "") -> None:
        super().__init__(message)
        self.lever = lever
