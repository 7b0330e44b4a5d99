"""Layered instance-level ``forward`` overrides that can be removed in any order.

Checkpointing and fp32-kept modules both change how a module's forward runs without
changing the module tree or its state_dict keys: they set an instance attribute
``forward`` that calls the class's own forward. Each feature owns one named layer; this
module rebuilds the chain whenever a layer is added or removed, so removing one never
disturbs another, and removing all of them restores the module exactly.

Layers are ``functools.partial`` objects over module-level functions (no closures), so a
wrapped model can still be deep-copied and pickled.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["forward_layers", "set_forward_layer"]

_KEY = "_memfit_forward_layers"
_BASE = "_memfit_forward_base"
_Wrap = Callable[..., Any]


def forward_layers(module: nn.Module) -> dict[str, Any]:
    """The memfit layers on ``module`` (tag -> layer data), in the order they apply."""
    return dict(module.__dict__.get(_KEY, {}))


def set_forward_layer(module: nn.Module, tag: str, wrapper: _Wrap | None, *data: Any) -> None:
    """Add, replace (``wrapper`` given) or remove (``wrapper=None``) the layer ``tag``.

    ``wrapper(inner, *data, *args, **kwargs)`` is called in place of the forward below it.
    """
    layers: dict[str, tuple[_Wrap, tuple[Any, ...]]] = module.__dict__.get(_KEY, {})
    if not layers:
        if wrapper is None:
            return
        module.__dict__[_BASE] = module.__dict__.get("forward")
    layers = dict(layers)
    if wrapper is None:
        layers.pop(tag, None)
    else:
        layers[tag] = (wrapper, data)
    base = module.__dict__.get(_BASE)
    if not layers:
        module.__dict__.pop(_KEY, None)
        module.__dict__.pop(_BASE, None)
        if base is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = base
        return
    fwd: Callable[..., Any] = base if base is not None else types.MethodType(type(module).forward, module)
    for fn, args in layers.values():
        fwd = functools.partial(fn, fwd, *args)
    module.__dict__[_KEY] = layers
    module.__dict__["forward"] = fwd
