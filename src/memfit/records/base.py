"""The JSON round-trip every record shares: ``to_dict`` / ``from_dict`` / ``to_json`` / ``from_json``.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Point(Record):
    ...     x: int
    >>> Point.from_json(Point(3).to_json())
    Point(x=3)
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, TypeVar

from memfit.errors import ConfigError
from memfit.typed_json import decode

__all__ = ["Record"]

_R = TypeVar("_R", bound="Record")


class Record:
    """Mixin: ``to_dict`` / ``from_dict`` / ``to_json`` / ``from_json`` for dataclasses."""

    def to_dict(self) -> dict[str, Any]:
        """Return the record as JSON-ready nested dicts and lists."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_json(self, indent: int | None = 2) -> str:
        """Return the record as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls: type[_R], data: dict[str, Any]) -> _R:
        """Build the record from :meth:`to_dict` output, checking every field's type.

        Raises:
            ConfigError: ``data`` is not a dict, has unknown or missing fields, or a value of
                the wrong type (also a ``ValueError``).
        """
        name = cls.__name__
        if not isinstance(data, dict):
            raise ConfigError(f"{name} must be a JSON object, got {type(data).__name__}")
        if isinstance(data.get("memfit"), str):
            # the marker of a file memfit wrote (memfit.outputs.MARKER): not a field
            data = {k: v for k, v in data.items() if k != "memfit"}
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        unknown = set(data) - {f.name for f in fields}
        if unknown:
            raise ConfigError(f"{name} has no field(s) {sorted(map(str, unknown))}")
        missing = [
            f.name
            for f in fields
            if f.name not in data
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigError(f"{name} lacks the field(s) {missing}")
        values = {k: decode(hints[k], v, f"{name}.{k}") for k, v in data.items()}
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"{name} cannot be built: {exc}") from None

    @classmethod
    def from_json(cls: type[_R], text: str) -> _R:
        """Build the record from :meth:`to_json` output.

        Raises:
            ConfigError: the text is not JSON, or not this record (see :meth:`from_dict`).
        """
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"not valid JSON for a {cls.__name__}: {str(exc)[:200]}") from None
        return cls.from_dict(data)
