"""Layered instance-level ``forward`` overrides that can be removed in any order.

Checkpointing, segments, fp32-kept modules and offload all change how a module's forward
runs without changing the module tree or its state_dict keys: they set an instance attribute
``forward`` that calls the class's own forward. Each feature owns one named layer (a
:class:`ForwardLayer`); this module rebuilds the chain whenever a layer is added or removed,
so removing one never disturbs another, and removing all of them restores the module exactly.

Layers are ``functools.partial`` objects over module-level functions (no closures), so a
wrapped model can still be deep-copied and pickled.

Example:
    >>> from torch import nn
    >>> def doubled(inner, factor, x):
    ...     return factor * inner(x)
    >>> m = nn.Identity()
    >>> set_forward_layer(m, "demo", doubled, 2)
    >>> m(3), forward_layers(m)["demo"].state
    (6, 2)
    >>> set_forward_layer(m, "demo", None)
    >>> m(3), "forward" in m.__dict__
    (3, False)
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["ForwardLayer", "forward_layers", "set_forward_layer"]

_KEY = "_memfit_forward_layers"
_BASE = "_memfit_forward_base"


@dataclass(frozen=True)
class ForwardLayer:
    """One override: ``wrapper(inner, state, *args, **kwargs)`` (``wrapper(inner, *args,
    **kwargs)`` where ``state`` is None) runs in place of the forward below it."""

    wrapper: Callable[..., Any]
    state: Any = None
    """What the wrapper reads (a block's checkpointing mode, its segment, a device type)."""

    def over(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        """This layer's forward on top of ``inner``."""
        if self.state is None:
            return functools.partial(self.wrapper, inner)
        return functools.partial(self.wrapper, inner, self.state)


def forward_layers(module: nn.Module) -> dict[str, ForwardLayer]:
    """The memfit layers on ``module`` (tag -> layer), in the order they apply."""
    return dict(module.__dict__.get(_KEY, {}))


def set_forward_layer(
    module: nn.Module, tag: str, wrapper: Callable[..., Any] | None, state: Any = None
) -> None:
    """Add, replace (``wrapper`` given) or remove (``wrapper=None``) the layer ``tag``."""
    layers: dict[str, ForwardLayer] = module.__dict__.get(_KEY, {})
    if not layers:
        if wrapper is None:
            return
        module.__dict__[_BASE] = module.__dict__.get("forward")
    layers = dict(layers)
    if wrapper is None:
        layers.pop(tag, None)
    else:
        layers[tag] = ForwardLayer(wrapper, state)
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
    for layer in layers.values():
        fwd = layer.over(fwd)
    module.__dict__[_KEY] = layers
    module.__dict__["forward"] = fwd
