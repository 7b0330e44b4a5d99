"""Memory budgets: ``"6GiB"``, ``"500MB"``, ``"60%"`` or an int number of bytes.

This is the one place that reads a user's budget, so the CLI, the config file and the
Python API accept the same spellings and refuse the same mistakes. A budget is parsed once,
at the edge, into a :class:`Budget`: either a number of bytes or a fraction of a baseline
(memfit takes percentages of the fp32, no-checkpointing peak). Whoever knows the baseline
(the planner, after measuring it) resolves the budget to bytes with :meth:`Budget.resolve`.

Trade-off: a percentage cannot be turned into bytes until the baseline is measured, so its
syntax is checked at once and its size only later; a byte budget is complete when parsed.

Example:
    >>> parse_bytes("1.5GiB")
    1610612736
    >>> Budget.parse("60%").resolve(1000)
    600
    >>> Budget.parse("60%").is_fraction, str(Budget.parse("500MB"))
    (True, '500MB')
    >>> Budget.parse("device").resolve(None, room=3000)
    3000
    >>> format_bytes(1610612736)
    '1.50 GiB'
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from memfit.errors import ConfigError

__all__ = ["Budget", "format_bytes", "parse_bytes"]

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
_PATTERN = re.compile(r"^ *([+-]?[0-9]+(?:\.[0-9]*)?|[+-]?\.[0-9]+) *([a-zA-Z]*|%) *$", re.ASCII)
#: What a budget's text may hold: ASCII digits, letters, signs, a point, ``%`` and spaces.
_ALLOWED = re.compile(r"^[0-9A-Za-z+\-.% ]*$", re.ASCII)
#: Larger than any memory there is (1 EiB); a budget above it is a typo, not a machine.
_MAX_BYTES = 2**60


@dataclass(frozen=True)
class Budget:
    """A parsed budget: a number of bytes, a fraction of a baseline peak still unknown, or
    ``"device"``: what the device has room for (read by the planner).

    At most one of ``bytes`` and ``fraction`` is set (neither for ``"device"``). ``text`` is
    what the user wrote, for messages and reports.
    """

    bytes: int | None = None
    """The budget in bytes (None for a percentage)."""
    fraction: float | None = None
    """The budget as a fraction in (0, 1] of the baseline peak (None for bytes)."""
    text: str = ""
    """The budget as the user gave it."""
    device: bool = False
    """``"device"``: the device's room (its free memory, less the allocator's margin)."""

    @classmethod
    def parse(cls, value: Budget | int | float | str, what: str = "budget") -> Budget:
        """Read int bytes, ``"6GiB"``, ``"500MB"``, ``"60%"`` or ``"device"``.

        Raises:
            ConfigError: the value cannot be read, is not positive, is under one byte, or is
                a percentage outside (0, 100].
        """
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ConfigError(
                f"{what} must be a number of bytes or a string like '6GiB', not {_shown(value)}."
            )
        if isinstance(value, int | float):
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{what} must be a positive number of bytes, got {_shown(value)}.")
            return cls(bytes=_whole_bytes(value, value, what), text=str(value))
        if value.strip(" ").lower() == "device":
            return cls(device=True, text="device")
        if not _ALLOWED.fullmatch(value):
            bad = next(c for c in value if not _ALLOWED.fullmatch(c))
            raise ConfigError(
                f"cannot read {what} {_shown(value)}: its character {bad!r} (U+{ord(bad):04X}) is not an "
                "ASCII digit, letter, sign, '.', '%' or space; write it as e.g. '6GiB'."
            )
        match = _PATTERN.fullmatch(value)
        if match is None or match.group(2).lower() not in (*_UNITS, "%"):
            raise ConfigError(
                f"cannot read {what} {_shown(value)}: write bytes as an integer, or a number with a unit "
                "(B, KB, MB, GB, KiB, MiB, GiB), a percentage such as '60%', or 'device'."
            )
        number = float(match.group(1))
        unit = match.group(2).lower()
        if not math.isfinite(number):
            raise ConfigError(
                f"{what} {_shown(value)} is too large to be a memory size; give bytes such as '6GiB'."
            )
        if number <= 0:
            raise ConfigError(f"{what} must be positive, got {_shown(value)}.")
        if unit == "%":
            if number > 100:
                raise ConfigError(
                    f"{what} {_shown(value)} is over 100% of the baseline peak; "
                    "give a percentage in (0, 100]."
                )
            return cls(fraction=number / 100, text=value.strip())
        return cls(bytes=_whole_bytes(number * _UNITS[unit], value, what), text=value.strip())

    @property
    def is_fraction(self) -> bool:
        """True for a percentage, which needs the baseline peak to become bytes."""
        return self.fraction is not None

    def resolve(self, baseline_bytes: int | None, what: str = "budget", room: int | None = None) -> int:
        """The budget in bytes; a percentage is taken of ``baseline_bytes``, ``"device"`` is ``room``.

        Raises:
            ConfigError: a percentage with no baseline, ``"device"`` with no room known, or
                either coming to under a byte.
        """
        if self.bytes is not None:
            return self.bytes
        if self.device:
            if room is None or room <= 0:
                raise ConfigError(
                    f"{what} 'device' needs the device's free memory, which is not known here; "
                    "give bytes such as '6GiB' instead."
                )
            return room
        if baseline_bytes is None:
            raise ConfigError(
                f"{what} {self.text!r} is a percentage, but nothing to take it of is known here; "
                "give bytes such as '6GiB' instead."
            )
        result = int(baseline_bytes * (self.fraction or 0.0))
        if result <= 0:
            raise ConfigError(f"{what} {self.text!r} is less than one byte; give a positive amount.")
        return result

    def __str__(self) -> str:
        return self.text or (f"{(self.fraction or 0) * 100:g}%" if self.is_fraction else str(self.bytes))


def _shown(value: object) -> str:
    """``repr(value)``, shortened to about 40 characters for messages (400 nines stay readable)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:18]}...{text[-18:]} ({len(text)} characters)"


def _whole_bytes(number: float, shown: object, what: str) -> int:
    if number > _MAX_BYTES:
        raise ConfigError(
            f"{what} {_shown(shown)} is too large to be a memory size; give bytes such as '6GiB'."
        )
    result = int(number)
    if result <= 0:
        raise ConfigError(f"{what} {_shown(shown)} is less than one byte; give a positive amount.")
    return result


def parse_bytes(value: Budget | int | float | str, reference: int | None = None, what: str = "budget") -> int:
    """Turn a budget into a positive number of bytes (``Budget.parse(value).resolve(reference)``).

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
    return Budget.parse(value, what).resolve(reference, what)


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
