"""Which tensors an op writes into: what its schema declares, and what it writes without saying so.

A recompute is exact only if memfit knows, op by op, what a block's forward overwrites (its
inputs, the outputs selective checkpointing keeps, its buffers). An op's schema marks the
arguments it writes (``Tensor(a!)``), but not every op says so: eager BatchNorm
(``aten.native_batch_norm``) updates its running statistics without a mark, and without
moving their version counters.

See Note [writes an op does not declare]

Example:
    >>> import torch
    >>> x, y = torch.zeros(2), torch.ones(2)
    >>> [t is x for t in written_by(torch.ops.aten.add_.Tensor, (x, y), {})]
    [True]
    >>> written_by(torch.ops.aten.add.Tensor, (x, y), {})
    []
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = [
    "arg_tensors",
    "hidden_key",
    "learn_hidden",
    "learned_hidden",
    "schema_hidden",
    "storage_key",
    "values_unknown",
    "written_by",
]

# Note [writes an op does not declare]
# An op that writes into an argument its schema does not mark is found by its effect: the
# first time a watched forward passes a buffer to an op not yet known, memfit keeps a copy
# of that argument, runs the op, and compares. What changed is remembered for the op and
# its flag arguments together (``native_batch_norm`` writes its running statistics when
# ``training`` is True, and only reads them when it is False), and is treated like a
# declared write from then on. The copy is made once per op and flags in a process (the
# first, warm-up step); later steps copy nothing.

#: The schema's write slots of each op: (position, name) of its ``Tensor(a!)`` arguments.
_DECLARED: dict[Any, tuple[tuple[int, str], ...]] = {}
#: What ops write without declaring it, by op and flag arguments (positions written).
_HIDDEN: dict[tuple[Any, tuple[Any, ...]], tuple[int, ...]] = {}
#: Ops with at least one hidden write (the others skip the flag lookup).
_HIDDEN_OPS: set[Any] = set()
#: PyTorch's account of the hidden writes, by op and flag arguments (positions).
_SCHEMA_HIDDEN: dict[tuple[Any, tuple[Any, ...]], tuple[int, ...]] = {}


def storage_key(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage (tensors that alias share it); None where it has none."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested: no plain storage
        return None


def arg_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[int, torch.Tensor]]:
    """(position, tensor) of an op's positional tensor arguments and the tensors in lists among them;
    keyword tensors get position -1."""
    out: list[tuple[int, torch.Tensor]] = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            out.append((i, a))
        elif isinstance(a, list | tuple):
            out.extend((i, v) for v in a if isinstance(v, torch.Tensor))
    out.extend((-1, v) for v in kwargs.values() if isinstance(v, torch.Tensor))
    return out


def _declared(func: Any) -> tuple[tuple[int, str], ...]:
    slots = _DECLARED.get(func)
    if slots is None:
        schema = getattr(func, "_schema", None)
        arguments = schema.arguments if schema is not None else []
        slots = tuple(
            (i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        _DECLARED[func] = slots
    return slots


def hidden_key(func: Any, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """The key hidden writes are remembered by: the op and its flag (bool) arguments."""
    return func, tuple(a for a in args if isinstance(a, bool))


def learned_hidden(func: Any, args: tuple[Any, ...]) -> tuple[int, ...] | None:
    """The positions ``func`` with these flags writes without declaring; None if not yet learned."""
    return _HIDDEN.get(hidden_key(func, args))


def learn_hidden(func: Any, args: tuple[Any, ...], positions: tuple[int, ...]) -> None:
    """Remember that ``func`` with these flags writes ``positions`` without declaring them."""
    _HIDDEN[hidden_key(func, args)] = positions
    if positions:
        _HIDDEN_OPS.add(func)


# Note [hidden writes without values]
# Under fake tensors (memfit.estimate, a planner's twin) an op's effect cannot be seen: its
# arguments have no values to compare. There the hidden writes are PyTorch's own account of
# them, torch._C._SchemaInfo, which knows the training ops (native_batch_norm writes its
# running statistics when `training` is True) from the op's flag arguments: the fake step
# then copies what a real step that has learned the op copies. It is not learned from: an
# op only a real step can show to write (a custom kernel) is still found by its effect.


def values_unknown(t: torch.Tensor) -> bool:
    """Whether ``t`` has no values to compare (a fake tensor that is not a constant, or meta)."""
    return t.is_meta or (isinstance(t, FakeTensor) and t.constant is None)


def schema_hidden(func: Any, args: tuple[Any, ...]) -> tuple[int, ...]:
    """The positions PyTorch's schema information says ``func`` writes with these flag
    arguments but its schema does not mark (See Note [hidden writes without values]).

    Example:
        >>> bn = torch.ops.aten.native_batch_norm.default
        >>> x, stats = torch.zeros(2, 3), torch.zeros(3)
        >>> schema_hidden(bn, (x, None, None, stats, stats, True, 0.1, 1e-5))
        (3, 4)
    """
    key = hidden_key(func, args)
    found = _SCHEMA_HIDDEN.get(key)
    if found is None:
        found = _SCHEMA_HIDDEN[key] = _schema_mutable(func, args)
    return tuple(i for i in found if i < len(args) and isinstance(args[i], torch.Tensor))


def _schema_mutable(func: Any, args: tuple[Any, ...]) -> tuple[int, ...]:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    info = torch._C._SchemaInfo(schema)
    flags: dict[str, object] = {
        str(a.name): v for a, v in zip(schema.arguments, args, strict=False) if isinstance(v, bool)
    }
    if flags:
        info.add_argument_values(flags)
    declared = {i for i, _ in _declared(func)}
    mutable = torch._C._SchemaArgType.input
    return tuple(
        i
        for i in range(len(schema.arguments))
        if i not in declared and info.is_mutable(torch._C._SchemaArgument(mutable, i))
    )


def _hidden(func: Any, args: tuple[Any, ...]) -> tuple[int, ...]:
    if func in _HIDDEN_OPS:
        return _HIDDEN.get(hidden_key(func, args), ())
    if learned_hidden(func, args) is None and any(
        values_unknown(a) for a in args if isinstance(a, torch.Tensor)
    ):
        return schema_hidden(func, args)
    return ()


def written_by(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``func`` writes into: its schema's ``Tensor(a!)`` arguments and the hidden
    writes learned for it (see Note [writes an op does not declare]), or, on tensors without
    values, PyTorch's account of them (See Note [hidden writes without values])."""
    out: list[torch.Tensor] = []
    for i, name in _declared(func):
        value = args[i] if i < len(args) else kwargs.get(name)
        values = value if isinstance(value, list | tuple) else [value]
        out.extend(v for v in values if isinstance(v, torch.Tensor))
    out.extend(args[i] for i in _hidden(func, args) if i < len(args) and isinstance(args[i], torch.Tensor))
    return out
