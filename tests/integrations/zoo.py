"""The third-party zoo: models from transformers, torchvision and timm, small, with their defaults.

The entries live in :mod:`zoo_hf` and :mod:`zoo_vision`, and the third round's in
:mod:`zoo_blocks3` (blocks a person would pick), :mod:`zoo_estimate3` (estimates that need
real values) and :mod:`zoo_order3` (blocks not run in module order, random depth);
:func:`all_entries` lists them all.

Each :class:`Entry` builds one architecture from its library (random weights, no download)
with a small configuration and every other setting at its default (Hugging Face decoders
keep ``use_cache=True``, vision models keep their in-place activations), the loss it trains
with (Hugging Face: ``labels=``), a small batch for numerics and a larger one for planning
(where activations dominate the step), and the blocks a person would checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

Batch = Any

#: Checkpointed and plain steps run the same fp32 kernels; a recompute may reorder reductions.
TOL = {"rtol": 1e-5, "atol": 1e-6}
#: How far a plan's measured peak may be from its prediction.
PREDICTION = 0.05
VARIANTS: dict[str, dict[str, Any]] = {
    "full": {"mode": "full"},
    "selective": {"mode": "selective"},
    "every2": {"mode": "full", "every": 2},
}


@dataclass
class Entry:
    name: str
    """``library/model``: the test id."""
    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    batch: Callable[[int], Batch]
    """Batch of a given size (the first dimension)."""
    blocks: list[str]
    """The blocks a person would checkpoint, in module order."""
    small: int = 2
    """Batch size for the numerics checks."""
    large: int = 16
    """Batch size for the plan check (activations dominate the step)."""
    covers: str = ""
    """What the model adds to the zoo (decoder with cache, encoder-decoder, ...)."""
    estimate: bool = False
    """Also check ``memfit.estimate`` against the measured plain peak (within 5%)."""


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def layers(prefix: str, n: int = 2) -> list[str]:
    """``prefix.0 ... prefix.{n-1}``."""
    return [f"{prefix}.{i}" for i in range(n)]


def all_entries() -> list[Entry]:
    from zoo_blocks3 import BLOCKS3
    from zoo_estimate3 import ESTIMATE3
    from zoo_hf import HF
    from zoo_order3 import ORDER3
    from zoo_vision import VISION

    return HF + VISION + BLOCKS3 + ESTIMATE3 + ORDER3


#: The libraries the zoo's entries come from: the first part of an entry's name, its import name.
LIBRARIES = ("transformers", "torchvision", "timm")


def available(entry: Entry) -> Any:
    """``entry`` as a pytest parameter named for it, skipped where its library is not installed."""
    have = entry.name.split("/")[0]
    if have not in LIBRARIES:
        raise ValueError(f"zoo entry {entry.name!r} names no library of {LIBRARIES}")
    try:
        __import__(have)
    except ImportError:
        return pytest.param(entry, id=entry.name, marks=pytest.mark.skip(reason=f"{have} not installed"))
    return pytest.param(entry, id=entry.name)
