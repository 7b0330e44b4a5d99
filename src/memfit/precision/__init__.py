"""Precisions: :class:`Precision` (one made for a device: autocast, loss scaler, fp32-kept
modules) and the precisions it can be, one object each (:class:`PrecisionKind`: :mod:`.fp32`,
:mod:`.bf16`, :mod:`.fp16`), listed once in :mod:`.registry`.

Trade-off: bf16 and fp16 halve the bytes of most activations and run faster where the
hardware computes in them natively; fp16 needs dynamic loss scaling because its range is
small (largest value 65504), and some modules (losses, norms over long sums) are better
kept in fp32 via ``fp32_modules``.

Example:
    >>> p = Precision("fp32", device="cpu")
    >>> p.mode, p.scaler.is_enabled()
    ('fp32', False)
    >>> Precision("fp16", device="cpu").scaler.is_enabled()
    True
"""

from memfit.precision.core import DTYPES, Precision, as_precision
from memfit.precision.kind import PrecisionKind
from memfit.precision.registry import PRECISION_KINDS, precision_kind

__all__ = ["DTYPES", "PRECISION_KINDS", "Precision", "PrecisionKind", "as_precision", "precision_kind"]
