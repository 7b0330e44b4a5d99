"""What the levers need that may be missing: torchao (the low-precision AdamW, NF4), and an
Adam-like optimizer to carry over.

Example:
    >>> isinstance(torchao_available(), bool), ADAM_LIKE
    (True, ('Adam', 'AdamW'))
"""

from __future__ import annotations

import importlib.util

__all__ = ["ADAM_LIKE", "TORCHAO_INSTALL", "torchao_available"]

#: Optimizers whose state levers and bf16 weights can be carried over (same hyper-parameters).
ADAM_LIKE = ("Adam", "AdamW")
#: The one command that installs what the torchao levers need.
TORCHAO_INSTALL = "pip install 'memfit[levers]'"


def torchao_available() -> bool:
    """Whether torchao (the low-precision AdamW optimizers) can be imported."""
    try:
        return importlib.util.find_spec("torchao") is not None
    except (ImportError, ValueError, AttributeError):  # an import blocked in sys.modules
        return False
