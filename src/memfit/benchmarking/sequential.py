"""Run a model's blocks through ``torch.utils.checkpoint.checkpoint_sequential``, honestly.

``checkpoint_sequential(functions, segments, x)`` splits a chain of modules into segments
and checkpoints all but the last, keeping only the segment boundaries for backward.
Trade-off: with ``segments = sqrt(n)`` it keeps about ``2 sqrt(n)`` block inputs instead of
all ``n`` blocks' activations, at the cost of one more forward of every checkpointed
segment; it only applies where the blocks form one plain chain (each block's only input
is the previous block's output).

Most models do not call an ``nn.Sequential`` of their blocks; they loop over an
``nn.ModuleList`` (``for block in self.blocks: x = block(x)``). :func:`install_sequential`
proves by a probe forward that the model's forward *is* such a chain, then routes it: the
first block runs ``checkpoint_sequential`` over every block's own forward and the others
pass their input through. A model whose forward is not a plain chain of its blocks is
refused with the reason (:class:`NotSequential`), never approximated.

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
from torch.utils.checkpoint import checkpoint_sequential

from memfit.checkpointing import find_blocks
from memfit.checkpointing.layers import set_forward_layer
from memfit.errors import MemfitError
from memfit.planning.standard import sqrt_segments

__all__ = ["NotSequential", "install_sequential", "sqrt_segments", "uninstall_sequential"]

_TAG = "sequential"


class NotSequential(MemfitError):
    """The model's forward is not a plain chain of its blocks, so checkpoint_sequential cannot run it."""


def _chain_forward(
    inner: Callable[..., Any], functions: list[Callable[..., Any]], segments: int, x: Any
) -> Any:
    return checkpoint_sequential(functions, segments, x, use_reentrant=False)


def _pass_through(inner: Callable[..., Any], x: Any) -> Any:
    return x


def _probe(model: nn.Module, blocks: list[nn.Module], names: list[str], run: Callable[[], Any]) -> None:
    """Run a forward and check that it calls the blocks as one chain; raise NotSequential if not."""
    calls: list[tuple[int, tuple[Any, ...], dict[str, Any], Any]] = []
    index = {id(b): i for i, b in enumerate(blocks)}

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        calls.append((index[id(module)], args, kwargs, out))

    handles = [b.register_forward_hook(hook, with_kwargs=True) for b in blocks]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    order = [c[0] for c in calls]
    if order != list(range(len(blocks))):
        seen = [names[i] for i in order]
        raise NotSequential(f"the forward calls the blocks as {seen}, not once each in order {names}")
    for i, args, kwargs, out in calls:
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise NotSequential(f"block {names[i]} is called with other arguments than one tensor")
        if not isinstance(out, torch.Tensor):
            raise NotSequential(f"block {names[i]} returns {type(out).__name__}, not one tensor")
        if i > 0 and args[0] is not calls[i - 1][3]:
            raise NotSequential(
                f"block {names[i]} does not take block {names[i - 1]}'s output as its input "
                "(the forward changes it between blocks)"
            )


def install_sequential(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batch: Any,
    segments: int | None = None,
) -> nn.Module:
    """Make ``model`` run its blocks with ``checkpoint_sequential`` (in place; returns it).

    Args:
        model: a model without memfit checkpointing; its blocks are :func:`find_blocks`'.
        loss_fn: ``loss_fn(model, batch)``; used for two probe forwards (eval mode, no grad).
        batch: a batch the model takes.
        segments: number of segments (the last is not checkpointed); default
            :func:`sqrt_segments` of the block count.

    Returns:
        The same model. Its module tree and state_dict keys are unchanged.

    Raises:
        NotSequential: no blocks, or the forward is not a plain chain of them (the probe
            saw another call order, other arguments, or a changed tensor between blocks;
            or routing the chain changed the loss, e.g. a block's output is used twice).
    """
    names = find_blocks(model)
    if not names:
        raise NotSequential(f"found no repeated blocks in {type(model).__name__}")
    blocks = [model.get_submodule(n) for n in names]
    if len(blocks) < 2:
        raise NotSequential(f"checkpoint_sequential needs at least 2 blocks, {type(model).__name__} has 1")
    segments = sqrt_segments(len(blocks)) if segments is None else segments
    if not 2 <= segments <= len(blocks):
        raise NotSequential(f"segments must be between 2 and {len(blocks)}, got {segments}")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _probe(model, blocks, names, lambda: loss_fn(model, batch))
            reference = loss_fn(model, batch)
            # NOTE: each block's own forward (below memfit's layer) is what the chain runs,
            # so the routed blocks never call themselves; hooks on the blocks themselves
            # do not fire inside the chain (hooks on their submodules do).
            functions = [b.forward for b in blocks]
            set_forward_layer(blocks[0], _TAG, _chain_forward, functions, segments)
            for b in blocks[1:]:
                set_forward_layer(b, _TAG, _pass_through)
            routed = loss_fn(model, batch)
        # NOTE: a model that uses an intermediate block's output elsewhere (a U-Net skip)
        # passes the probe but would see the chain's final output there: the loss changes.
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
    """Remove what :func:`install_sequential` added."""
    for module in model.modules():
        set_forward_layer(module, _TAG, None)
    return model
