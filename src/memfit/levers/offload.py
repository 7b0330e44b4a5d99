"""Activations of chosen blocks offloaded to host memory (the ``offload`` lever, CUDA only).

Each chosen block's forward runs under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``:
every tensor it saves for its backward is copied to pinned host memory as it is saved and
copied back when its backward needs it. The device then holds none of the block's saved
activations between its forward and its backward, at the cost of two copies over the
host link. On a CPU the "host" is the memory the activations are already in: it saves
nothing, so :mod:`memfit.applying.offload` refuses it there.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> offload_blocks(model, ["0"]); offloaded_blocks(model)
    ['0']
    >>> clear_offload(model); offloaded_blocks(model)
    []
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from memfit.checkpointing.layers import forward_layers, set_forward_layer

__all__ = ["clear_offload", "offload_blocks", "offloaded_blocks"]

_TAG = "offload"


def _offloaded(inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
        return inner(*args, **kwargs)


def offload_blocks(model: nn.Module, names: Iterable[str]) -> None:
    """Offload the saved activations of the named blocks (others are left as they are)."""
    for name in names:
        set_forward_layer(model.get_submodule(name), _TAG, _offloaded)


def clear_offload(model: nn.Module) -> None:
    """Offload no block of ``model``."""
    for module in model.modules():
        set_forward_layer(module, _TAG, None)


def offloaded_blocks(model: nn.Module) -> list[str]:
    """Names of the modules whose saved activations are offloaded."""
    return [n for n, m in model.named_modules() if _TAG in forward_layers(m)]
