"""Fresh copies for benchmarking: an optimizer like the user's, batches on the device, parking.

Each strategy trains its own deep copy of the model with its own optimizer, built like the
user's (same class, same parameter groups and settings). On a GPU the copies that are not
running are parked in host memory, so the CUDA allocator's peak of one strategy's step
counts that strategy alone. Trade-off: parking costs a host-device copy per turn (outside
the timed region) and host memory for every copy.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> twin = torch.nn.Linear(2, 2)
    >>> fresh_optimizer(opt, model, twin).param_groups[0]["momentum"]
    0.9
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.step import Batch

__all__ = [
    "OptimizerArg",
    "Parked",
    "batch_to",
    "check_optimizer",
    "fresh_optimizer",
    "park",
    "unpark",
]

#: An optimizer over the model's parameters (used as a template), ``optimizer_fn(params)``, or None.
OptimizerArg = torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None
#: One parked optimizer-state tensor: (the state dict, its key, the device it came from).
Parked = tuple[dict[Any, Any], Any, torch.device]


def check_optimizer(template: OptimizerArg, model: nn.Module) -> None:
    """Refuse an optimizer over parameters that are not the model's (before anything runs)."""
    if isinstance(template, torch.optim.Optimizer):
        own = {id(p) for p in model.parameters()}
        if any(id(p) not in own for g in template.param_groups for p in g["params"]):
            raise ConfigError(
                "the optimizer holds parameters that are not the model's; build it from "
                "model.parameters() or pass optimizer=lambda params: ..."
            )


def fresh_optimizer(template: OptimizerArg, original: nn.Module, model: nn.Module) -> Any:
    """A new optimizer for ``model`` like ``template`` (same class and groups), or ``template(params)``."""
    if template is None:
        return None
    if not isinstance(template, torch.optim.Optimizer):
        return template(model.parameters())
    check_optimizer(template, original)
    index = {id(p): i for i, p in enumerate(original.parameters())}
    params = list(model.parameters())
    groups = []
    for group in template.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        groups.append({**settings, "params": [params[index[id(p)]] for p in group["params"]]})
    # ``defaults`` may hold keys the constructor does not take (AdamW's
    # ``decoupled_weight_decay``); every group already carries its own settings, so only
    # the constructor's own keywords are passed, for optimizers whose lr has no default.
    accepted = inspect.signature(type(template)).parameters
    kwargs = {k: v for k, v in template.defaults.items() if k in accepted and k != "params"}
    return type(template)(groups, **kwargs)


def batch_to(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, tuple | list):
        return type(batch)(t.to(device) if isinstance(t, torch.Tensor) else t for t in batch)
    return batch


def park(model: nn.Module | None, optimizer: Any, device: torch.device) -> list[Parked]:
    """On a GPU, move a model and its optimizer state to the CPU; returns what to move back.

    Parameters keep their identity (``Module.to`` swaps their data), so the optimizer still
    holds them; gradients are dropped (the next step sets them to None anyway). On a CPU
    nothing moves.
    """
    parked: list[Parked] = []
    if device.type != "cuda" or model is None:
        return parked
    model.to("cpu")
    for p in model.parameters():
        p.grad = None
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device == device:
                    state[key] = value.to("cpu")
                    parked.append((state, key, device))
    return parked


def unpark(model: nn.Module | None, parked: list[Parked], device: torch.device) -> None:
    """Undo :func:`park`: the model and the parked optimizer state go back to ``device``."""
    if device.type != "cuda" or model is None:
        return
    model.to(device)
    for state, key, dev in parked:
        state[key] = state[key].to(dev)
    parked.clear()
