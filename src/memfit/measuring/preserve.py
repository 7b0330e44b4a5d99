"""Save and restore what a measurement may change: weights, buffers, grads, optimizer, RNG."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from memfit.compiled import eager

__all__ = ["create_optimizer_state", "preserved"]


@contextlib.contextmanager
def preserved(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """Run the body, then put model, optimizer, gradients and RNG back as they were.

    The body runs a compiled model eagerly (:func:`memfit.compiled.eager`): measurements
    are of the eager step, and leave the compiled model free to compile its new plan.

    Example:
        >>> m = nn.Linear(2, 2)
        >>> before = m.weight.detach().clone()
        >>> with preserved(m):
        ...     _ = m.weight.data.add_(1.0)
        >>> bool(torch.equal(m.weight, before))
        True
    """
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in model.parameters()]
    opt_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    training = model.training
    try:
        with eager():
            yield
    finally:
        model.load_state_dict(state)
        for p, g in grads:
            p.grad = g
        if optimizer is not None and opt_state is not None:
            optimizer.load_state_dict(opt_state)
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
