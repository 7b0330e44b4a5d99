"""Run a model's blocks through ``torch.utils.checkpoint.checkpoint_sequential``, honestly.

``checkpoint_sequential(functions, segments, x)`` splits a chain of modules into segments
and checkpoints all but the last, keeping only the segment boundaries for backward.
Trade-off: with ``segments = sqrt(n)`` it keeps about ``2 sqrt(n)`` block inputs instead of
all ``n`` blocks' activations, at the cost of one more forward of every checkpointed
segment; it only applies where the blocks form one plain chain (each block's only input
is the previous block's output).

Most models do not call an ``nn.Sequential`` of their blocks; they loop over an
``nn.ModuleList`` (``for block in self.blocks: x = block(x)``). :func:`install_sequential`
proves by a probe forward (:func:`memfit.checkpointing.segments.chain_probe`) that the
model's forward *is* such a chain, then checkpoints checkpoint_sequential's segments with
memfit's one chain mechanism (:func:`memfit.checkpointing.segments.set_segments`; its peak
is byte-identical to ``checkpoint_sequential``'s, which ``tests/planning/test_plan_standard.py``
measures). A model whose forward is not a plain chain of its blocks is refused with the
reason (:class:`NotSequential`), never approximated.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    >>> x = torch.randn(2, 4)
    >>> _ = install_sequential(model, lambda m, b: m(b).sum(), x)
    >>> model(x).shape
    torch.Size([2, 4])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.checkpointing import find_blocks, set_block_modes, set_segments, uncheckpoint
from memfit.checkpointing.segments import ChainProbe, chain_probe
from memfit.errors import ConfigError, MemfitError
from memfit.planning.standard import sqrt_segments

__all__ = ["NotSequential", "install_sequential", "sequential_split", "uninstall_sequential"]


class NotSequential(MemfitError):
    """The model's forward is not a plain chain of its blocks, so checkpoint_sequential cannot run it."""


def sequential_split(n_blocks: int, segments: int) -> list[list[int]]:
    """The blocks ``checkpoint_sequential(functions, segments, x)`` checkpoints, segment by
    segment: ``n // segments`` blocks each, all segments but the last.

    Example:
        >>> sequential_split(5, 2), sequential_split(9, 3)
        ([[0, 1]], [[0, 1, 2], [3, 4, 5]])
    """
    size = n_blocks // segments
    return [list(range(i * size, (i + 1) * size)) for i in range(segments - 1)]


def _refuse_broken_chain(probe: ChainProbe, names: list[str]) -> None:
    """Raise NotSequential naming the first place the probed forward is not one chain."""
    for k, call in enumerate(probe.calls):
        if call is None:
            raise NotSequential(f"the forward does not call block {names[k]}")
    for k, linked in enumerate(probe.links):
        if linked:
            continue
        before, after = probe.calls[k], probe.calls[k + 1]
        assert before is not None and after is not None
        if after[0] != before[1]:
            raise NotSequential(
                f"block {names[k + 1]} does not take block {names[k]}'s output as its input "
                "(the forward changes it between blocks)"
            )
        raise NotSequential(f"block {names[k + 1]} is called with other arguments than block {names[k]}")


def install_sequential(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batch: Any,
    segments: int | None = None,
) -> nn.Module:
    """Make ``model`` checkpoint its blocks as ``checkpoint_sequential`` does (in place; returns it).

    Args:
        model: a model without memfit checkpointing; its blocks are :func:`find_blocks`'.
        loss_fn: ``loss_fn(model, batch)``; used for two probe forwards (eval mode).
        batch: a batch the model takes.
        segments: number of segments (the last is not checkpointed); default
            :func:`~memfit.planning.standard.sqrt_segments` of the block count.

    Returns:
        The same model. Its module tree and state_dict keys are unchanged.

    Raises:
        NotSequential: no blocks, or the forward is not a plain chain of them (the probe saw
            a block not called, another input than the previous block's output, or other
            arguments; or checkpointing the chain changed the loss, e.g. a block's output is
            used twice).
    """
    names = find_blocks(model)
    if not names:
        raise NotSequential(f"found no repeated blocks in {type(model).__name__}")
    if len(names) < 2:
        raise NotSequential(f"checkpoint_sequential needs at least 2 blocks, {type(model).__name__} has 1")
    segments = sqrt_segments(len(names)) if segments is None else segments
    if not 2 <= segments <= len(names):
        raise NotSequential(f"segments must be between 2 and {len(names)}, got {segments}")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), chain_probe(model, names) as probe:
            reference = loss_fn(model, batch)
        _refuse_broken_chain(probe, names)
        runs = [[names[j] for j in run] for run in sequential_split(len(names), segments)]
        set_segments(model, [run for run in runs if len(run) > 1])
        set_block_modes(model, {run[0]: "full" for run in runs if len(run) == 1})
        # Segments checkpoint only where gradients are recorded: the loss is compared so.
        try:
            with torch.enable_grad():
                routed = loss_fn(model, batch).detach()
        except ConfigError as exc:  # a segment's later block is not called as the chain's next
            uninstall_sequential(model)
            raise NotSequential(str(exc).rstrip(".")) from None
        # A model that uses an intermediate block's output elsewhere (a U-Net skip) passes the
        # probe, but a segment hands the later blocks its last output: the loss changes.
        if not torch.allclose(routed.float(), reference.float(), rtol=1e-5, atol=1e-6):
            uninstall_sequential(model)
            raise NotSequential(
                "running the blocks as one chain changed the loss (an intermediate block output "
                "is used elsewhere)"
            )
    finally:
        model.train(was_training)
    return model


def uninstall_sequential(model: nn.Module) -> nn.Module:
    """Remove what :func:`install_sequential` added (all of memfit's checkpointing)."""
    return uncheckpoint(model)
