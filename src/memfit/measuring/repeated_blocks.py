"""Measure each distinct block once: identical blocks stand in for each other.

A transformer's layers are one module class with the same shapes, so their numbers are
the same: a 32-layer model need not run 32 blocks in every mode. Within each run of three
or more consecutive identical residual blocks (same class, parameter shapes, output shaped
like the input), the blocks between the run's first and last pass their input through
(an instance-level forward layer, removed after); the first block stands for them (its
output feeds a block of the same kind, as theirs does) and the last for itself (its
output feeds what follows the run). :func:`memfit.stepmodel.simulate` adds the numbers up
for every block; the tests compare the result with measured peaks.

Trade-off: only blocks proven identical and residual are skipped; anything else runs.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    >>> stand_ins(model, ["0", "1", "2", "3"], [True] * 4)
    {'1': '0', '2': '0'}
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from memfit import progress
from memfit.checkpointing import set_block_modes
from memfit.checkpointing.layers import set_forward_layer
from memfit.devices import model_device
from memfit.measuring.phases import StepMemory, grad_bytes_of, param_bytes, phased_step, profile_from_memory
from memfit.measuring.tracker import PhaseTracker
from memfit.precision import Precision
from memfit.records import Profile
from memfit.step import Batch, LossFn, batch_size
from memfit.vocab import CheckpointMode, PrecisionName

__all__ = [
    "fast_profiles",
    "identical",
    "mode_steps",
    "optimizer_temp",
    "outputs_keep_shape",
    "skipping",
    "stand_ins",
    "steps_per_mode",
]

_SKIP = "estimate-skip"


def _signature(model: nn.Module, name: str) -> tuple[Any, ...]:
    m = model.get_submodule(name)
    tensors = [*m.named_parameters(), *m.named_buffers()]
    return (type(m), tuple((k, tuple(t.shape), t.dtype, t.requires_grad) for k, t in tensors))


def identical(model: nn.Module, blocks: list[str]) -> bool:
    """True when every block has the same class and the same parameter and buffer shapes."""
    first = _signature(model, blocks[0])
    return all(_signature(model, b) == first for b in blocks[1:])


def stand_ins(model: nn.Module, blocks: Sequence[str], keeps_shape: Sequence[bool]) -> dict[str, str]:
    """Blocks that need not run, each mapped to the block whose numbers it takes.

    Args:
        model: the model; blocks: its blocks in forward order.
        keeps_shape: per block, whether it returns one tensor shaped like its input.
    """
    sigs = [_signature(model, b) for b in blocks]
    out: dict[str, str] = {}
    i = 0
    while i < len(blocks):
        j = i
        while j + 1 < len(blocks) and sigs[j + 1] == sigs[i]:
            j += 1
        if j - i >= 2 and all(keeps_shape[k] for k in range(i, j + 1)):
            out.update({blocks[k]: blocks[i] for k in range(i + 1, j)})
        i = j + 1
    return out


def _pass_through(inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return args[0]


@contextlib.contextmanager
def skipping(model: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Inside, the named blocks return their first argument without computing."""
    for name in names:
        set_forward_layer(model.get_submodule(name), _SKIP, _pass_through)
    try:
        yield
    finally:
        for name in names:
            set_forward_layer(model.get_submodule(name), _SKIP, None)


def outputs_keep_shape(model: nn.Module, name: str, batch: Batch, loss_fn: LossFn) -> bool:
    """Whether block ``name`` returns a tensor shaped like its first input (a residual block)."""
    seen: list[bool] = []

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        first = args[0] if args else None
        seen.append(
            isinstance(first, torch.Tensor)
            and isinstance(output, torch.Tensor)
            and output.shape == first.shape
            and output.dtype == first.dtype
        )

    handle = model.get_submodule(name).register_forward_hook(hook)
    try:
        with torch.no_grad():
            loss_fn(model, batch)
    finally:
        handle.remove()
    return bool(seen) and all(seen)


def fast_profiles(
    model: nn.Module,
    step: tuple[Batch, LossFn],
    optimizer: torch.optim.Optimizer | None,
    blocks: list[str],
    skipped: dict[str, str],
    precisions: list[PrecisionName],
    modes: list[CheckpointMode],
    make_precision: Callable[[PrecisionName], Precision],
) -> dict[str, Profile]:
    """Profiles of identical residual blocks from steps that run only those ``skipped`` does
    not map (:func:`stand_ins`: the first and last of each run).

    The optimizer step, which does not depend on the blocks, is tracked separately with
    every gradient present.
    """
    profiles: dict[str, Profile] = {}
    with skipping(model, list(skipped)):
        for precision in precisions:
            short = steps_per_mode(model, step, optimizer, make_precision(precision), blocks, modes, skipped)
            short.param_bytes = param_bytes(model)
            short.grad_bytes = grad_bytes_of(model)
            short.outside.param_bytes = short.param_bytes - sum(b.param_bytes for b in short.blocks)
            profiles[precision] = short
    temp = optimizer_temp(model, optimizer)
    for prof in profiles.values():
        prof.optimizer_temp_bytes = temp
    return profiles


def steps_per_mode(
    model: nn.Module,
    step: tuple[Batch, LossFn],
    optimizer: torch.optim.Optimizer | None,
    precision: Precision,
    blocks: list[str],
    modes: Sequence[CheckpointMode],
    skipped: dict[str, str],
    what: str = "steps per checkpointing mode",
) -> Profile:
    """One step (forward and backward, no optimizer step) per mode with every block that runs
    at that mode, as a profile's memory fields: the blocks ``skipped`` maps (passed through by
    :func:`skipping`, which the caller holds) take their stand-in's numbers. Shown as the
    counted phase ``<precision>: <what> (<run> of <all> blocks run)``.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> x = torch.randn(2, 4)
        >>> prof = steps_per_mode(model, (x, lambda m, b: m(b).sum()), None, Precision("fp32"),
        ...                       ["0", "1"], ["none", "full"], {})
        >>> sorted(prof.blocks[0].saved_bytes)
        ['full', 'none']
    """
    active = [b for b in blocks if b not in skipped]
    with progress.phase(
        f"{precision.mode}: {what} ({len(active)} of {len(blocks)} blocks run)", len(modes)
    ) as ph:
        per_mode = mode_steps(model, step, optimizer, precision, active, modes, ph)
    return profile_from_memory(model, blocks, per_mode, precision.mode, batch_size(step[0]), skipped)


def mode_steps(
    model: nn.Module,
    step: tuple[Batch, LossFn],
    optimizer: torch.optim.Optimizer | None,
    precision: Precision,
    active: list[str],
    modes: Sequence[CheckpointMode],
    shown: progress.Phase,
    around: Callable[[CheckpointMode], contextlib.AbstractContextManager[object]] | None = None,
) -> dict[CheckpointMode, StepMemory]:
    """One tracked step (forward and backward, no optimizer step) per mode, every block of
    ``active`` in that mode and ``around(mode)`` held while it runs; ``shown`` advances per mode.
    The blocks are left in the last mode (the caller puts them back).

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> step = (torch.randn(2, 4), lambda m, b: m(b).sum())
        >>> with progress.phase("modes", 2) as ph:
        ...     mem = mode_steps(model, step, None, Precision("fp32"), ["0", "1"], ["none", "full"], ph)
        >>> sorted(mem), mem["full"].peak <= mem["none"].peak
        (['full', 'none'], True)
    """
    per_mode: dict[CheckpointMode, StepMemory] = {}
    for mode in modes:
        set_block_modes(model, {b: mode for b in active})
        with around(mode) if around is not None else contextlib.nullcontext():
            per_mode[mode] = phased_step(
                model, step[0], step[1], optimizer, precision, active, step_optimizer=False
            )
        shown.advance(detail=mode)
    return per_mode


def optimizer_temp(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Highest bytes above parameters, gradients and state during ``optimizer.step()``."""
    if optimizer is None:
        return 0
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    tracker = PhaseTracker(model_device(model), {}, {})
    tracker.track_external(model, optimizer)
    with tracker:
        tracker.enter_phase("optimizer")
        start = tracker.total()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return max(0, tracker.phase_peak["optimizer"] - start)
