"""Random depth measured at its worst: every layer runs while memfit measures a step.

Some models skip whole layers at random in training: Hugging Face's LayerDrop
(``Wav2Vec2Config.layerdrop = 0.1`` by default, ``encoder_layerdrop`` and
``decoder_layerdrop`` in BART, Whisper and others), read either from the model's config or
from a module attribute copied from it. A step that happened to skip a layer keeps less
than one that does not, so a profile measured on one random draw can sit below the next
step's peak (Wav2Vec2: 13% under). :func:`every_layer_runs` turns LayerDrop off for the
steps memfit measures, so the profile and every prediction made from it are the worst
case, all layers run; training afterwards skips layers as the model says and holds at
most that. See Note [random depth at its worst].

Drop path (timm's ``DropPath``, torchvision's ``StochasticDepth``) multiplies a branch by
a random mask: the branch always runs, so it changes no byte and needs nothing here.

Example:
    >>> from torch import nn
    >>> class Encoder(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.layerdrop = 0.1
    >>> enc = Encoder()
    >>> with every_layer_runs(enc):
    ...     enc.layerdrop
    0.0
    >>> enc.layerdrop
    0.1
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["both", "every_layer_runs", "layer_drops"]

# Note [random depth at its worst]
# LayerDrop is a probability read at every forward (``if self.training and
# torch.rand([]) < self.config.layerdrop: skip the layer``). Setting every such attribute
# to 0 while a step is measured makes that step run every layer; the values are put back
# after. Only positive float attributes whose name ends in ``layerdrop`` are touched, on
# the modules and on the config objects they hold. A block that may be skipped is no link
# of a chain: a profile of a model with LayerDrop has no chain links (no segments).


def layer_drops(model: nn.Module) -> list[tuple[Any, str, float]]:
    """``(owner, attribute, probability)`` of every positive LayerDrop setting in ``model``."""
    owners: dict[int, Any] = {}
    for module in model.modules():
        owners.setdefault(id(module), module)
        config = getattr(module, "config", None)
        if config is not None and not isinstance(config, nn.Module):
            owners.setdefault(id(config), config)
    found = []
    for owner in owners.values():
        for name, value in list(vars(owner).items()):
            if name.endswith("layerdrop") and isinstance(value, float) and value > 0.0:
                found.append((owner, name, value))
    return found


@contextlib.contextmanager
def every_layer_runs(model: nn.Module) -> Iterator[list[tuple[Any, str, float]]]:
    """Turn LayerDrop off inside (the settings turned off are yielded), and back on after."""
    drops = layer_drops(model)
    for owner, name, _ in drops:
        setattr(owner, name, 0.0)
    try:
        yield drops
    finally:
        for owner, name, value in drops:
            setattr(owner, name, value)


@contextlib.contextmanager
def both(
    first: contextlib.AbstractContextManager[Any], second: contextlib.AbstractContextManager[Any]
) -> Iterator[None]:
    """Enter ``first``, then ``second``; leave them in reverse."""
    with first, second:
        yield
