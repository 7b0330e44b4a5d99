"""Save and restore what a measurement may change: weights, buffers, grads, optimizer, RNG."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from memfit.checkpointing.compile import eager
from memfit.devices import address_space_limited, model_device
from memfit.measuring.spill import spillable, spilled

__all__ = ["create_optimizer_state", "preserved"]


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``; an accelerator's tensors are copied to host memory, so that measuring
    does not need the device's room twice over (``load_state_dict`` copies them back)."""
    if t.device.type in ("cuda", "mps", "xpu"):
        return t.detach().to("cpu", copy=True)
    return t.detach().clone()


def _optimizer_snapshot(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict with every tensor copied (see :func:`_snapshot`) and its
    containers new (the pytree map rebuilds them)."""
    snapshot: dict[str, Any] = tree_map_only(torch.Tensor, _snapshot, optimizer.state_dict())
    return snapshot


def _model_snapshot(model: nn.Module) -> OrderedDict[str, Any]:
    """The model's state dict with every tensor copied, its ``_metadata`` kept (the versions
    a module's ``_load_from_state_dict`` reads: torchvision's MNASNet refuses a state without
    them)."""
    state = model.state_dict()
    copied: OrderedDict[str, Any] = OrderedDict((k, _snapshot(v)) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        copied._metadata = metadata  # type: ignore[attr-defined]
    return copied


@contextlib.contextmanager
def _kept(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Weights, buffers, gradients and optimizer state as they are now, put back afterwards:
    copied in memory, or (under an address-space limit on a CPU) written to a file.

    See Note [address space under RLIMIT_AS].
    """
    if address_space_limited(model_device(model)) and spillable(model, optimizer):
        with spilled(model, optimizer):
            yield
        return
    state = _model_snapshot(model)
    grads = [(p, None if p.grad is None else _snapshot(p.grad)) for p in model.parameters()]
    opt_state = _optimizer_snapshot(optimizer) if optimizer is not None else None
    try:
        yield
    finally:
        _restore(model, optimizer, state, grads, opt_state)


def _restore(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: OrderedDict[str, Any],
    grads: list[tuple[nn.Parameter, torch.Tensor | None]],
    opt_state: dict[str, Any] | None,
) -> None:
    model.load_state_dict(state)
    for p, g in grads:
        p.grad = g
    if optimizer is not None and opt_state is not None:
        optimizer.load_state_dict(opt_state)


@contextlib.contextmanager
def preserved(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """Run the body, then put model, optimizer, gradients and RNG back as they were.

    The copies of a GPU's weights, gradients and optimizer state are kept in host memory;
    on a CPU whose address space is limited (``RLIMIT_AS``), in a temporary file
    (See Note [address space under RLIMIT_AS]).

    The body runs a compiled model eagerly (:func:`memfit.checkpointing.compile.eager`): measurements
    are of the eager step, and leave the compiled model free to compile its new plan.

    Example:
        >>> m = nn.Linear(2, 2)
        >>> before = m.weight.detach().clone()
        >>> with preserved(m):
        ...     _ = m.weight.data.add_(1.0)
        >>> bool(torch.equal(m.weight, before))
        True
    """
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    training = model.training
    try:
        with _kept(model, optimizer), eager():
            yield
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        model.train(training)


def create_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Create the optimizer's state with one step on zero gradients (no forward needed).

    It changes the weights and the state: call it inside :func:`preserved`.
    """
    if optimizer is None or optimizer.state:
        return
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
