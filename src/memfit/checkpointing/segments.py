"""Checkpoint a run of consecutive blocks as one segment, as ``checkpoint_sequential`` does.

A segment keeps only its input and its last block's output for the backward, and
recomputes all its blocks there; one checkpoint call serves them all. Models rarely call
an ``nn.Sequential`` of their blocks; they loop (``for block in self.blocks: h = block(h,
mask)``). So the segment's first block runs the whole chain under one non-reentrant
``torch.utils.checkpoint.checkpoint``, calling each later block with the previous one's
output and the first block's other arguments, and the later blocks, when the model calls
them, check that they are called exactly so (the previous output, the same other
arguments) and hand back the result. A model that does not call its blocks that way gets
an error, never a silently different result.

:func:`chain_probe` finds where that holds (``Profile.chain_links``) from one forward:
block k+1's first argument is block k's output (or its first element) and its other
arguments are block k's.

Trade-off: a segment's layers live on every block of it, so ``memfit.checkpointing.checkpointed_blocks``
reports its blocks as ``full`` and ``memfit.uncheckpoint`` removes it like any other
checkpointing.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> _ = set_segments(model, [["0", "1", "2"]])
    >>> model(x).sum().backward()
    >>> x.grad.shape
    torch.Size([2, 4])
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.checkpointing.hf import without_caches
from memfit.checkpointing.layers import forward_layers, set_forward_layer
from memfit.checkpointing.modes import LAYER_TAG, BlockLayer, refuse_double_checkpointing
from memfit.checkpointing.recompute import run_checkpointed
from memfit.errors import ConfigError

__all__ = ["ChainProbe", "applied_segments", "chain_probe", "set_segments"]


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, tuple | list) and out else out


class _Segment:
    """One segment's blocks and what its current forward passed along (cleared at its end)."""

    def __init__(self, modules: list[nn.Module], names: list[str]) -> None:
        self.modules = modules
        self.names = names
        self.group = nn.ModuleList(modules)
        """The blocks as one module, whose buffers the segment's recompute puts back.

        See Note [buffers a forward writes]
        """
        self.running = False
        self.active = False
        self.next = 1
        self.output: Any = None
        self.rest: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}

    def clear(self) -> None:
        self.active, self.output, self.rest, self.kwargs = False, None, (), {}


@dataclass(frozen=True)
class _SegmentLayer(BlockLayer):
    """A block's layer inside a segment: checkpointed (``full``) with the segment's other blocks."""

    seg: _Segment


def _chain(inner: Callable[..., Any], seg: _Segment, *args: Any, **kwargs: Any) -> Any:
    """Run every block of the segment; the later ones through their own layers (``running``)."""
    seg.running = True
    try:
        out = inner(*args, **kwargs)
        for module in seg.modules[1:]:
            out = module(_first(out), *args[1:], **kwargs)
        return out
    finally:
        seg.running = False


def _head(inner: Callable[..., Any], layer: _SegmentLayer, *args: Any, **kwargs: Any) -> Any:
    seg = layer.seg
    if seg.running:
        return inner(*args, **kwargs)
    if not torch.is_grad_enabled() or not args:
        seg.clear()  # nothing to save for a backward: every block runs as it is
        return inner(*args, **kwargs)
    # Hugging Face caches off while training, as for a block checkpointed alone; the later
    # blocks are still matched against the arguments the model passed.
    # See Note [caches off in a recompute]
    # One checkpointed call runs the whole chain, with a block's own protections: copies
    # before in-place writes to its inputs, buffers written once, a recompute per backward.
    run_args, run_kwargs, _ = without_caches(args, kwargs, layer.module)
    label = f"segment {seg.names[0]}..{seg.names[-1]}"
    out = run_checkpointed(
        functools.partial(_chain, inner, seg), seg.group, "full", run_args, run_kwargs, label
    )
    seg.active, seg.next, seg.output, seg.rest, seg.kwargs = True, 1, out, args[1:], dict(kwargs)
    return out


def _same(a: Any, b: Any) -> bool:
    return a is b or (not isinstance(a, torch.Tensor) and type(a) is type(b) and a == b)


def _member(inner: Callable[..., Any], layer: _SegmentLayer, *args: Any, **kwargs: Any) -> Any:
    seg, module = layer.seg, layer.module
    if seg.running or not seg.active:
        return inner(*args, **kwargs)
    name = seg.names[seg.next]
    called_as_chain = (
        bool(args)
        and args[0] is _first(seg.output)
        and len(args) - 1 == len(seg.rest)
        and all(_same(a, b) for a, b in zip(args[1:], seg.rest, strict=True))
        and kwargs.keys() == seg.kwargs.keys()
        and all(_same(kwargs[k], seg.kwargs[k]) for k in kwargs)
    )
    if not called_as_chain or seg.modules[seg.next] is not module:
        seg.clear()
        raise ConfigError(
            f"block {name!r} is planned inside a segment starting at {seg.names[0]!r}, but the model "
            "does not call it with the previous block's output and the same other arguments; "
            "plan again (memfit plan) or apply the plan without segments."
        )
    out = seg.output
    seg.next += 1
    if seg.next == len(seg.modules):
        seg.clear()
    return out


def set_segments(model: nn.Module, segments: Sequence[Sequence[str]]) -> nn.Module:
    """Checkpoint each run of consecutive blocks in ``segments`` as one segment (in place).

    Args:
        model: the model; blocks not named keep their own layers.
        segments: lists of two or more qualified block names, in the order the model calls them.

    Returns:
        The same model.

    Raises:
        ConfigError: a name is not a module of the model, or a segment has fewer than two blocks.
    """
    modules = dict(model.named_modules())
    for names in segments:
        names = list(names)
        missing = [n for n in names if n not in modules or not n]
        if missing or len(names) < 2:
            raise ConfigError(
                f"a segment needs two or more blocks of {type(model).__name__}, got {names}"
                + (f" ({missing} not found)" if missing else "")
                + "; plan again with memfit plan."
            )
        refuse_double_checkpointing(model)
        seg = _Segment([modules[n] for n in names], names)
        set_forward_layer(seg.modules[0], LAYER_TAG, _head, _SegmentLayer(seg.modules[0], "full", seg))
        for m in seg.modules[1:]:
            set_forward_layer(m, LAYER_TAG, _member, _SegmentLayer(m, "full", seg))
    return model


def applied_segments(model: nn.Module) -> list[list[str]]:
    """The segments :func:`set_segments` installed on ``model``, as lists of block names."""
    found = []
    for module in model.modules():
        layer = forward_layers(module).get(LAYER_TAG)
        if layer is not None and layer.wrapper is _head and isinstance(layer.state, _SegmentLayer):
            found.append(list(layer.state.seg.names))
    return found


class ChainProbe:
    """Records, during one forward, whether each block is called as the previous one's successor."""

    def __init__(self, n: int) -> None:
        self.calls: list[tuple[Any, ...] | None] = [None] * n
        self.keeps_shape = [False] * n
        """Per block: it returned one tensor shaped like its first argument (a residual block)."""

    @property
    def links(self) -> list[bool]:
        """``links[k]``: block k+1 took block k's output and block k's other arguments."""
        out = []
        for a, b in zip(self.calls, self.calls[1:], strict=False):
            out.append(a is not None and b is not None and b[0] == a[1] and b[2:] == a[2:])
        return out


def _ids(values: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(v if isinstance(v, bool | int | float | str | type(None)) else ("id", id(v)) for v in values)


@contextlib.contextmanager
def chain_probe(model: nn.Module, blocks: Sequence[str]) -> Iterator[ChainProbe]:
    """Watch the forward run inside: which consecutive blocks form a plain chain.

    Only ids are recorded (no tensor is kept alive), so it can watch a measured step.
    """
    probe = ChainProbe(len(blocks))
    handles = []
    for k, name in enumerate(blocks):

        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, k: int = k
        ) -> None:
            if probe.calls[k] is None and args:
                keys = tuple(sorted(kwargs))
                named = tuple(zip(keys, _ids([kwargs[x] for x in keys]), strict=True))
                probe.calls[k] = (id(args[0]), id(_first(out)), _ids(args[1:]), named)
                x = args[0]
                probe.keeps_shape[k] = (
                    isinstance(x, torch.Tensor)
                    and isinstance(out, torch.Tensor)
                    and (out.shape, out.dtype) == (x.shape, x.dtype)
                )

        handles.append(model.get_submodule(name).register_forward_hook(hook, with_kwargs=True))
    try:
        yield probe
    finally:
        for h in handles:
            h.remove()
