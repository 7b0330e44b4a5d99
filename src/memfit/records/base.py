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
import types
import typing
from typing import Any, TypeVar

__all__ = ["Record"]

_R = TypeVar("_R", bound="Record")


def _decode(tp: Any, value: Any) -> Any:
    """Rebuild ``value`` (parsed JSON) as type ``tp`` (nested records, lists, dicts)."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _decode(args[0], value) if len(args) == 1 else value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and issubclass(tp, Record):
        return tp.from_dict(value)
    if origin is list:
        return [_decode(typing.get_args(tp)[0], v) for v in value]
    if origin is tuple:
        targs = typing.get_args(tp)
        if len(targs) == 2 and targs[1] is Ellipsis:
            return tuple(_decode(targs[0], v) for v in value)
        return tuple(_decode(a, v) for a, v in zip(targs, value, strict=True))
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        return {k: _decode(val_tp, v) for k, v in value.items()}
    return value


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
        """Build the record from :meth:`to_dict` output; unknown keys are an error."""
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
        return cls(**{k: _decode(hints[k], v) for k, v in data.items()})

    @classmethod
    def from_json(cls: type[_R], text: str) -> _R:
        """Build the record from :meth:`to_json` output."""
        return cls.from_dict(json.loads(text))
