"""Parse memory budgets: ``"6GiB"``, ``"500MB"``, ``"60%"`` or an int number of bytes.

This is the one place that turns a user's budget into bytes, so the CLI, the config file
and the Python API all accept the same spellings and refuse the same mistakes.

Example:
    >>> parse_bytes("1.5GiB")
    1610612736
    >>> parse_bytes("60%", reference=1000)
    600
    >>> format_bytes(1610612736)
    '1.50 GiB'
"""

from __future__ import annotations

import math
import re

from memfit.errors import ConfigError

__all__ = ["format_bytes", "parse_bytes"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
#: The largest budget memfit takes (8 EiB): larger numbers are typing mistakes, and the
#: solver works in 64-bit integers.
_MAX_BYTES = 2**63 - 1
_PATTERN = re.compile(r"^\s*([+-]?\d+(?:\.\d*)?|[+-]?\.\d+)\s*([a-zA-Z]*|%)\s*$")


def parse_bytes(value: int | float | str, reference: int | None = None, what: str = "budget") -> int:
    """Turn a budget into a positive number of bytes.

    Args:
        value: int bytes, a string with a unit such as ``"6GiB"`` or ``"500MB"``, or a
            percentage such as ``"60%"``.
        reference: the byte count a percentage is taken of (memfit uses the fp32,
            no-checkpointing peak); a percentage without one is refused.
        what: the name used in error messages (``"budget"``, ``"device memory"``).

    Returns:
        The number of bytes, always > 0.

    Raises:
        ConfigError: the value cannot be read, is not positive, or is a percentage
            outside (0, 100] or without a reference.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a number of bytes or a string like '6GiB', not {_shown(value)}.")
    if isinstance(value, int | float):
        if (isinstance(value, float) and not math.isfinite(value)) or value <= 0:
            raise ConfigError(f"{what} must be a positive number of bytes, got {_shown(value)}.")
        return _checked(int(value), value, what)
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a number of bytes or a string like '6GiB', not {_shown(value)}.")
    match = _PATTERN.match(value)
    if match is None or match.group(2).lower() not in (*_UNITS, "%"):
        raise ConfigError(
            f"cannot read {what} {_shown(value)}: write bytes as an integer, or a number with a unit "
            "(B, KB, MB, GB, KiB, MiB, GiB), or a percentage such as '60%'."
        )
    number = float(match.group(1))
    unit = match.group(2).lower()
    if not math.isfinite(number):
        raise ConfigError(f"{what} {_shown(value)} is too large; give at most 8 EiB.")
    if number <= 0:
        raise ConfigError(f"{what} must be positive, got {_shown(value)}.")
    if unit == "%":
        if number > 100:
            raise ConfigError(
                f"{what} {_shown(value)} is over 100% of the baseline peak; give a percentage in (0, 100]."
            )
        if reference is None:
            raise ConfigError(
                f"{what} {_shown(value)} is a percentage, but nothing to take it of is known here; "
                "give bytes such as '6GiB' instead."
            )
        result = int(reference * number / 100)
    else:
        scaled = number * _UNITS[unit]
        if not math.isfinite(scaled):
            raise ConfigError(f"{what} {_shown(value)} is too large; give at most 8 EiB.")
        result = int(scaled)
    return _checked(result, value, what)


def _shown(value: object) -> str:
    """``repr(value)``, shortened to about 40 characters for messages."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:18]}...{text[-18:]} ({len(text)} characters)"


def _checked(result: int, value: object, what: str) -> int:
    if result <= 0:
        raise ConfigError(f"{what} {_shown(value)} is less than one byte; give a positive amount.")
    if result > _MAX_BYTES:
        raise ConfigError(f"{what} {_shown(value)} is too large; give at most 8 EiB.")
    return result


def format_bytes(n: int | float) -> str:
    """Format a byte count with a binary unit, e.g. ``'1.50 GiB'``."""
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
