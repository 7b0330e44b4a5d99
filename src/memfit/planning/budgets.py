"""A budget in bytes against what the device holds: the one gate every planning entry passes.

``memfit.plan``, the largest-batch search, ``memfit train`` and the torchrun plan all turn a
:class:`~memfit.budget.Budget` into bytes here, and refuse here a budget larger than the bytes
held now (weights, buffers, optimizer state) plus the device's room (:func:`memfit.devices.room`).

Example:
    >>> from memfit.budget import Budget
    >>> from memfit.devices import Room
    >>> resolve_in_room(Budget.parse("50%"), 1000, Room(free=10_000, source="test"), 0, "cpu")
    500
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.budget import Budget, format_bytes
from memfit.devices import Room
from memfit.errors import ConfigError
from memfit.measuring.phases import optimizer_state_bytes

__all__ = ["fixed_bytes", "held_bytes", "refuse_over_room", "resolve_in_room"]


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Parameters and buffers + optimizer state: what a step starts with."""
    params = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return params + sum(optimizer_state_bytes(optimizer).values())


def fixed_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Parameters and buffers + gradients of trainable parameters + optimizer state."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return held_bytes(model, optimizer) + grads


def refuse_over_room(budget_bytes: int, budget: Budget, r: Room | None, held: int, device: object) -> None:
    """Refuse, in one sentence naming both, a budget larger than the device can hold: the
    bytes ``held`` now (weights, buffers, optimizer state) plus the room ``r`` (None: unknown)."""
    if r is None or budget_bytes <= held + r.free:
        return
    of = f" ({budget} of the fp32 peak)" if budget.is_fraction else ""
    free = f"{format_bytes(r.free)} free by {r.source}"
    parts = f"{format_bytes(held)} of weights and optimizer state held now and {free}" if held else free
    raise ConfigError(
        f"the budget of {format_bytes(budget_bytes)}{of} is more than {device} has room for: "
        f"{format_bytes(held + r.free)} ({parts}); give at most that, or 'device'."
    )


def resolve_in_room(budget: Budget, peak: int, r: Room | None, held: int, device: object) -> int:
    """The budget in bytes: a percentage of ``peak``; ``"device"``: ``held`` plus the room less
    its margin. Refused (:func:`refuse_over_room`) where it is more than the device holds."""
    budget_bytes = budget.resolve(peak, room=held + r.usable if r is not None else None)
    refuse_over_room(budget_bytes, budget, r, held, device)
    return budget_bytes
