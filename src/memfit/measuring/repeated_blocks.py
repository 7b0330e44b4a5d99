"""Estimate a model whose blocks are identical by running two of them.

A 32-layer model under fake tensors costs a second per block and precision and mode; its
blocks are the same module with the same shapes, so their numbers are the same. Here the
other blocks pass their input through (an instance-level forward layer, removed after), two
blocks run, and :func:`memfit.stepmodel.simulate` adds the numbers up for all of
them. The tests compare the result with measured peaks.

Trade-off: only for residual blocks (output shaped like the first input) of one class with
identical parameter shapes; anything else takes the direct path (every block runs).

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    >>> identical(model, ["0", "1", "2"])
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.checkpointing import set_block_modes
from memfit.forward_layers import set_forward_layer
from memfit.measuring.phases import grad_bytes_of, phased_step
from memfit.measuring.profile import profile_from_memory
from memfit.measuring.tracker import PhaseTracker
from memfit.precision import Precision
from memfit.records import Profile
from memfit.step import Batch, LossFn, batch_size

__all__ = ["fast_profiles", "identical", "optimizer_temp", "outputs_keep_shape"]

_SKIP = "estimate-skip"


def identical(model: nn.Module, blocks: list[str]) -> bool:
    """True when every block has the same class and the same parameter and buffer shapes."""

    def signature(name: str) -> tuple[Any, ...]:
        m = model.get_submodule(name)
        tensors = [*m.named_parameters(), *m.named_buffers()]
        return (type(m), tuple((k, tuple(t.shape), t.dtype, t.requires_grad) for k, t in tensors))

    first = signature(blocks[0])
    return all(signature(b) == first for b in blocks[1:])


def _pass_through(inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return args[0]


def _set_skipped(model: nn.Module, blocks: list[str], skipped: bool) -> None:
    for name in blocks:
        set_forward_layer(model.get_submodule(name), _SKIP, _pass_through if skipped else None)


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
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    blocks: list[str],
    precisions: list[str],
    modes: list[str],
    make_precision: Callable[[str], Precision],
) -> dict[str, Profile]:
    """Profiles of identical blocks from steps that run only the first two of them.

    NOTE: a block's numbers do not depend on how many identical blocks run before and
    after it (each is taken at its own boundaries, and the tests check the sums against
    measured peaks), only on whether its output feeds another block or the outside part.
    So the other blocks pass their input through: the first block stands for every block
    but the last, the second for the last, and the step costs two blocks instead of all.
    The optimizer step, which does not depend on the blocks, is tracked separately with
    every gradient present.
    """
    active = blocks[:2]
    _set_skipped(model, blocks[2:], True)
    try:
        profiles = {}
        for precision in precisions:
            prec = make_precision(precision)
            per_mode = {}
            for mode in modes:
                set_block_modes(model, {b: mode for b in active})
                per_mode[mode] = phased_step(
                    model, batch, loss_fn, optimizer, prec, active, step_optimizer=False
                )
            short = profile_from_memory(model, active, per_mode, precision, batch_size(batch))
            # the last block's output feeds the outside part, the others' the next block
            first, last = short.blocks
            short.blocks = [dataclasses.replace(first, name=b) for b in blocks[:-1]]
            short.blocks.append(dataclasses.replace(last, name=blocks[-1]))
            short.param_bytes = _param_bytes(model)
            short.grad_bytes = grad_bytes_of(model)
            short.outside.param_bytes = short.param_bytes - sum(b.param_bytes for b in short.blocks)
            profiles[precision] = short
    finally:
        _set_skipped(model, blocks[2:], False)
    temp = optimizer_temp(model, optimizer)
    for prof in profiles.values():
        prof.optimizer_temp_bytes = temp
    return profiles


def _param_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def optimizer_temp(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Highest bytes above parameters, gradients and state during ``optimizer.step()``."""
    if optimizer is None:
        return 0
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    tracker = PhaseTracker(next(p.device for p in model.parameters()), {}, {})
    tracker.track_external(model, optimizer)
    with tracker:
        tracker.enter_phase("optimizer")
        start = tracker.total()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return max(0, tracker.phase_peak["optimizer"] - start)
