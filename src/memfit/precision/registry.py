"""The precisions, listed once: a new one is a module (a :class:`~memfit.precision.kind.PrecisionKind`),
one line below, and its name in :data:`memfit.vocab.PrecisionName` (the type checker's list).

Example:
    >>> list(PRECISION_KINDS)
    ['fp32', 'bf16', 'fp16']
"""

from __future__ import annotations

from memfit.errors import UnsupportedPrecision
from memfit.precision.bf16 import BF16
from memfit.precision.fp16 import FP16
from memfit.precision.fp32 import FP32
from memfit.precision.kind import PrecisionKind

__all__ = ["PRECISION_KINDS", "precision_kind"]

#: Every precision by name, in :data:`memfit.vocab.PRECISIONS`' order.
PRECISION_KINDS: dict[str, PrecisionKind] = {kind.name: kind for kind in (FP32, BF16, FP16)}


def precision_kind(name: str) -> PrecisionKind:
    """The precision called ``name``.

    Raises:
        UnsupportedPrecision: no precision has that name.
    """
    kind = PRECISION_KINDS.get(name)
    if kind is None:
        raise UnsupportedPrecision(f"unknown precision {name!r}; use one of {', '.join(PRECISION_KINDS)}.")
    return kind
