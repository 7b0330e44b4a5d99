"""The words memfit's options are spelled with, defined once: precisions and checkpoint modes.

Every module that takes a precision or a checkpointing mode (the planner, the estimate, the
bench, the config, the CLI, the stability check) reads its list and its checks from here,
so a new mode or precision is added in one place and refused with the same sentence
everywhere.

Trade-off: the names are ``Literal`` types for the type checker and plain strings at run
time (configs, JSON plans and the command line hold strings); :func:`normalize_mode` and
:func:`normalize_precision` are the one gate from a string to a checked name.

Example:
    >>> normalize_mode("keep")           # the spelling of plans saved before 0.2
    'none'
    >>> normalize_precision("auto", allow_auto=True)
    'auto'
    >>> PRECISIONS, CHECKPOINT_MODES
    (('fp32', 'bf16', 'fp16'), ('none', 'selective', 'full'))
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Literal

from memfit.errors import ConfigError

__all__ = [
    "CHECKPOINT_MODES",
    "DISTRIBUTED_MODES",
    "GUARD_ACTIONS",
    "LEVERS",
    "MAXIMIZE",
    "MIXED_PRECISIONS",
    "PRECISIONS",
    "PRECISION_CHOICES",
    "SCHEDULES",
    "STRATEGY_ORDER",
    "WEIGHTS",
    "CheckpointMode",
    "DistributedMode",
    "GuardAction",
    "LeverName",
    "Maximize",
    "PrecisionChoice",
    "PrecisionName",
    "Schedule",
    "WeightsName",
    "normalize_mode",
    "normalize_modes",
    "normalize_precision",
]

#: A precision a step can run in: fp32, bf16 autocast, or fp16 autocast with loss scaling.
PrecisionName = Literal["fp32", "bf16", "fp16"]
#: A precision a user may ask for: one of :data:`PrecisionName` or ``auto`` (the device decides).
PrecisionChoice = Literal["fp32", "bf16", "fp16", "auto"]
#: How one block is checkpointed, from most memory and least compute to the reverse.
CheckpointMode = Literal["none", "selective", "full"]

PRECISIONS: tuple[PrecisionName, ...] = typing.get_args(PrecisionName)
#: The mixed precisions (autocast dtypes), the ones a stability check compares with fp32.
MIXED_PRECISIONS: tuple[PrecisionName, ...] = PRECISIONS[1:]
PRECISION_CHOICES: tuple[PrecisionChoice, ...] = typing.get_args(PrecisionChoice)
CHECKPOINT_MODES: tuple[CheckpointMode, ...] = typing.get_args(CheckpointMode)

#: What a plan may change beyond activations (see :mod:`memfit.levers`): the optimizer step
#: fused into the backward, the optimizer state in bf16 / 8 bits / 4 bits, bf16 weights
#: without an fp32 master copy, activations offloaded to host memory (CUDA only), each block's
#: MLP over chunks of the sequence, the loss head
#: (projection and cross-entropy) computed in chunks of tokens without the whole logits; the
#: frozen weights (``requires_grad=False``) in bf16, or their Linear weights in 4-bit NF4.
LeverName = Literal[
    "fused_step",
    "state_bf16",
    "state_8bit",
    "state_4bit",
    "weights_bf16",
    "offload",
    "tiled_mlp",
    "chunked_loss",
    "frozen_bf16",
    "frozen_nf4",
]
LEVERS: tuple[LeverName, ...] = typing.get_args(LeverName)
#: How several processes train under torchrun (``train.distributed``).
DistributedMode = Literal["none", "ddp", "fsdp2"]
DISTRIBUTED_MODES: tuple[DistributedMode, ...] = typing.get_args(DistributedMode)
#: What a guard does on a non-finite loss: stop, or fall back to a safer precision.
GuardAction = Literal["stop", "fallback"]
GUARD_ACTIONS: tuple[GuardAction, ...] = typing.get_args(GuardAction)
#: The learning-rate schedule after warm-up.
Schedule = Literal["constant", "cosine"]
SCHEDULES: tuple[Schedule, ...] = typing.get_args(Schedule)

#: What ``memfit.plan(..., maximize=)`` can ask for instead of the fastest plan.
Maximize = Literal["batch_size", "seq_len"]
MAXIMIZE: tuple[Maximize, ...] = typing.get_args(Maximize)

#: The dtypes floating weights are trained in: fp32 (as built), bf16 (the weights_bf16 lever).
WeightsName = Literal["fp32", "bf16"]
WEIGHTS: tuple[WeightsName, ...] = typing.get_args(WeightsName)

#: Strategies from fastest-looking to slowest-looking: lower precision first (tensor-core
#: matmuls are 2-16x faster than fp32 on GPUs; bf16 needs no loss scaling), then less recompute.
STRATEGY_ORDER: tuple[tuple[PrecisionName, CheckpointMode], ...] = tuple(
    (p, m) for p in ("bf16", "fp16", "fp32") for m in CHECKPOINT_MODES
)

# Note [the old spelling keep]
# Plans written before the vocabulary was unified called an unchanged block "keep".
# It is still read (saved plan.json files keep working) and always written as "none".
_OLD_MODE_SPELLINGS: dict[str, CheckpointMode] = {"keep": "none"}


def normalize_mode(mode: object, what: str = "checkpointing mode") -> CheckpointMode:
    """Check a checkpointing mode and return its one spelling (``keep`` reads as ``none``).

    Raises:
        ConfigError: ``mode`` is not one of :data:`CHECKPOINT_MODES`.
    """
    if isinstance(mode, str):
        mode = _OLD_MODE_SPELLINGS.get(mode, mode)
        if mode in CHECKPOINT_MODES:
            return typing.cast(CheckpointMode, mode)
    raise ConfigError(f"unknown {what} {mode!r}; use one of {', '.join(CHECKPOINT_MODES)}.")


def normalize_modes(modes: Mapping[str, object]) -> dict[str, CheckpointMode]:
    """Check every value of ``{block: mode}``; the error names all unknown ones at once.

    Raises:
        ConfigError: some modes are not one of :data:`CHECKPOINT_MODES`.
    """
    bad = {n: m for n, m in modes.items() if not (isinstance(m, str) and _known_mode(m))}
    if bad:
        raise ConfigError(f"unknown checkpointing mode(s) {bad}; use one of {', '.join(CHECKPOINT_MODES)}.")
    return {n: normalize_mode(m) for n, m in modes.items()}


def _known_mode(mode: str) -> bool:
    return _OLD_MODE_SPELLINGS.get(mode, mode) in CHECKPOINT_MODES


@typing.overload
def normalize_precision(
    precision: object, allow_auto: Literal[False] = False, what: str = "precision"
) -> PrecisionName: ...


@typing.overload
def normalize_precision(precision: object, allow_auto: bool, what: str = "precision") -> PrecisionChoice: ...


def normalize_precision(
    precision: object, allow_auto: bool = False, what: str = "precision"
) -> PrecisionChoice:
    """Check a precision name; ``auto`` is accepted only where the caller resolves it.

    Raises:
        ConfigError: ``precision`` is not a known name.
    """
    names: tuple[str, ...] = PRECISION_CHOICES if allow_auto else PRECISIONS
    if isinstance(precision, str) and precision in names:
        return typing.cast(PrecisionChoice, precision)
    raise ConfigError(f"unknown {what} {precision!r}; use one of {', '.join(names)}.")
