"""Parsed JSON checked against Python type hints: the typed half of every record's ``from_dict``.

A record read from a file (a ``plan.json`` someone edited, a profile from another machine)
is checked field by field, so a wrong type is one sentence naming the field
(``Plan.blocks must be dict, got 5``), never an ``AttributeError`` later.

Example:
    >>> decode(dict[str, int], {"a": 1})
    {'a': 1}
    >>> decode(list[int], [1, "2"], "xs")
    Traceback (most recent call last):
    ...
    memfit.errors.ConfigError: xs[1] must be int, got '2'
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from memfit.errors import ConfigError

__all__ = ["decode"]


def _bad(where: str, tp: Any, value: Any) -> ConfigError:
    name = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
    shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
    return ConfigError(f"{where} must be {name}, got {shown}")


def decode(tp: Any, value: Any, where: str = "value") -> Any:
    """Rebuild ``value`` (parsed JSON) as type ``tp`` (nested records, lists, dicts).

    Raises:
        ConfigError: ``value`` does not have the type ``tp`` (naming where: ``Plan.blocks``).
    """
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _bad(where, tp, value)
        for arg in (a for a in args if a is not type(None)):
            try:
                return decode(arg, value, where)
            except ConfigError:
                continue
        raise _bad(where, tp, value)
    if tp is Any:
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and hasattr(tp, "from_dict"):
        return tp.from_dict(value)
    if origin is list:
        if not isinstance(value, list):
            raise _bad(where, tp, value)
        return [decode(typing.get_args(tp)[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        targs = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise _bad(where, tp, value)
        if len(targs) == 2 and targs[1] is Ellipsis:
            return tuple(decode(targs[0], v, where) for v in value)
        if len(targs) != len(value):
            raise _bad(where, tp, value)
        return tuple(decode(a, v, where) for a, v in zip(targs, value, strict=True))
    if origin is dict:
        if not isinstance(value, dict):
            raise _bad(where, tp, value)
        _, val_tp = typing.get_args(tp)
        return {str(k): decode(val_tp, v, f"{where}[{k!r}]") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise _bad(where, tp, value)
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)  # JSON writers may write 3.0 for 3
        if not isinstance(value, int) or isinstance(value, bool):
            raise _bad(where, tp, value)
        return value
    if tp is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _bad(where, tp, value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _bad(where, tp, value)
        return value
    return value
