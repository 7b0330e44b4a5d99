"""torchao without its noise: what it and torch print on import and on the first step, kept for ``-v``.

Importing torchao logs ``Failed to load .../torchao/_C_mxfp8...so`` for each prebuilt kernel
built for another Python, CUDA or GPU, and torch logs a ``register_constant`` deprecation line
for torchao's enums; the first step of a low-bit optimizer warns ``OptimState4bit does not
implement _stable_hash_for_caching``. None of it is the user's to act on, and it reads like an
error. :func:`quiet_dependencies` holds these back unless memfit is verbose (``memfit -v``,
``MEMFIT_VERBOSE=1``, or the ``memfit`` logger at DEBUG); :func:`import_torchao` imports
torchao so, and says in one line which prebuilt kernels did not load (the levers do not use
them: torchao's AdamW step is compiled by ``torch.compile``, NF4 is plain torch).

Example:
    >>> import logging
    >>> with quiet_dependencies() as held:
    ...     logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.abi3.so: no")
    >>> [r.getMessage() for r in held], kernels_not_loaded(held)
    (['Failed to load /x/_C_mxfp8.abi3.so: no'], ['_C_mxfp8'])
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import types
import warnings
from collections.abc import Iterator, Sequence

from memfit import progress

__all__ = ["held_logs", "import_torchao", "kernels_not_loaded", "quiet_dependencies", "verbose"]

#: Loggers whose lines below ERROR are held back: torchao's own, and torch's that torchao's
#: import or step sets off (a deprecation, a missing triton, a missing CUDA runtime).
_LOGGERS = ("torchao", "torch.utils._pytree", "torch.utils.flop_counter", "torch.utils.cpp_extension")
#: Warnings raised inside torch while it compiles torchao's step.
_WARNINGS = (r"\w+ does not implement _stable_hash_for_caching",)
_FAILED = re.compile(r"Failed to load \S*?([\w]+?)(?:\.cpython[^/\s:]*|\.abi3)?\.so")


def verbose() -> bool:
    """Whether dependency messages are shown: ``MEMFIT_VERBOSE=1`` (``memfit -v``) or the
    ``memfit`` logger at DEBUG."""
    if os.environ.get("MEMFIT_VERBOSE", "").strip().lower() not in ("", "0", "false", "no", "off"):
        return True
    return logging.getLogger("memfit").isEnabledFor(logging.DEBUG)


class _Hold(logging.Filter):
    def __init__(self, held: list[logging.LogRecord], below: int) -> None:
        super().__init__()
        self.held, self.below = held, below

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.below:
            return True
        self.held.append(record)
        return False


@contextlib.contextmanager
def _holding(names: Sequence[str], below: int) -> Iterator[list[logging.LogRecord]]:
    held: list[logging.LogRecord] = []
    hold = _Hold(held, below)
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addFilter(hold)
    try:
        yield held
    finally:
        for logger in loggers:
            logger.removeFilter(hold)


@contextlib.contextmanager
def held_logs(*names: str) -> Iterator[list[logging.LogRecord]]:
    """Every line of the loggers ``names`` held back while the body runs, errors included, for a
    caller that reports the failure they log in a sentence of its own (torch 2.15's fake tensors
    log a traceback for a shape mismatch that memfit names in one sentence); ``logger.handle``
    shows one after all. Verbose: nothing is held.

    Example:
        >>> with held_logs("torch._subclasses.fake_tensor") as held:
        ...     logging.getLogger("torch._subclasses.fake_tensor").error("failed")
        >>> len(held) == (0 if verbose() else 1)
        True
    """
    if verbose():
        yield []
        return
    with _holding(names, logging.CRITICAL + 1) as held:
        yield held


@contextlib.contextmanager
def quiet_dependencies() -> Iterator[list[logging.LogRecord]]:
    """Hold back the dependency lines above while the body runs; yields the records held.

    Verbose (:func:`verbose`): nothing is held. Errors are never held.
    """
    if verbose():
        yield []
        return
    with _holding(_LOGGERS, logging.ERROR) as held, warnings.catch_warnings():
        for pattern in _WARNINGS:
            warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
        yield held


def kernels_not_loaded(held: Sequence[logging.LogRecord]) -> list[str]:
    """The prebuilt kernels (``_C_mxfp8``) that the ``Failed to load`` lines in ``held`` name."""
    found = (_FAILED.search(r.getMessage()) for r in held if r.name == "torchao")
    return [m.group(1) for m in found if m is not None]


@functools.cache
def import_torchao() -> types.ModuleType:
    """``torchao``, imported with its optimizers and NF4 quietly; one progress line names the
    prebuilt kernels that did not load (``memfit -v`` shows torchao's own lines)."""
    with quiet_dependencies() as held:
        import torchao
        import torchao.optim
        import torchao.quantization
    missing = kernels_not_loaded(held)
    if missing:
        progress.note(
            f"torchao's prebuilt kernels {', '.join(missing)} did not load here (built for another Python, "
            "CUDA or GPU); memfit's levers do not use them: torchao's AdamW step is compiled by "
            "torch.compile (memfit -v shows torchao's own lines)"
        )
    return torchao
