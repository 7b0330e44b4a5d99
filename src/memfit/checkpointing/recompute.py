"""One checkpointed call of a block: its forward now, and the recompute that backward runs.

memfit checkpoints a block with PyTorch's non-reentrant ``torch.utils.checkpoint``;
``selective`` adds PyTorch's selective-checkpoint (SAC) contexts. A recompute is right only
if it starts from what the forward started from and replays the same ops. Models written
for speed break that in three ways, and :func:`run_checkpointed` handles each:

- Argument containers the caller changes later (torchvision DenseNet appends each layer's
  output to the list every layer was given): the recompute gets containers copied at call
  time (lists, tuples, dicts, rebuilt around the same tensors).
- In-place ops on the block's own inputs (``x.relu_()`` as a block's first op): a watch
  sees every op of the forward and, just before one writes into an input's storage, copies
  that input once; the recompute starts from the copy. Nothing is copied for a block that
  does not write to its inputs.
- In-place ops on an output selective checkpointing keeps (a convolution followed by an
  in-place activation, as in timm's EfficientNet and CoAtNet): just before the write, the
  watch copies the kept output (copy-on-write) and the recompute is handed the copy in its
  place. Only the outputs actually overwritten are copied.

What the caller changes in place after the block returned cannot be seen; it is caught by a
version check when the recompute starts, with an error that names the block.

Example:
    >>> import torch
    >>> from torch import nn
    >>> block = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4))
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> y = run_checkpointed(block.forward, block, "full", (x * 1,), {})
    >>> y.sum().backward()  # the recompute starts from the input before relu_ wrote to it
    >>> x.grad.shape
    torch.Size([2, 4])
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as _ckpt
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from memfit.checkpointing.policy import (
    compiled_contexts,
    keep_running_stats,
    selective_policy,
    selective_saves,
)
from memfit.devices import model_device
from memfit.errors import CheckpointError
from memfit.vocab import CheckpointMode

__all__ = ["copies_made", "run_checkpointed"]

#: Ops SAC does not count (forward and recompute run different numbers of them).
_IGNORED: frozenset[Any] = frozenset(getattr(_ckpt, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default}))
_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}
_Key = tuple[Any, int]
#: What checkpointed calls of each block had to copy for their recompute (see copies_made).
_COPIES: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def copies_made(module: nn.Module, clear: bool = False) -> set[str]:
    """What checkpointed calls of ``module`` copied because an in-place op wrote to it:
    phrases such as ``"its input"``; empty when the block never wrote to what it needs.

    Example:
        >>> copies_made(nn.Linear(2, 2))
        set()
    """
    found = set(_COPIES.get(module, ()))
    if clear:
        _COPIES.pop(module, None)
    return found


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``func`` writes into (its schema's ``Tensor(a!)`` arguments)."""
    slots = _WRITES.get(func)
    if slots is None:
        schema = getattr(func, "_schema", None)
        arguments = schema.arguments if schema is not None else []
        slots = tuple(
            (i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        _WRITES[func] = slots
    out: list[torch.Tensor] = []
    for i, name in slots:
        value = args[i] if i < len(args) else kwargs.get(name)
        values = value if isinstance(value, list | tuple) else [value]
        out.extend(v for v in values if isinstance(v, torch.Tensor))
    return out


def _storage(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested: no plain storage
        return None


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class _BlockCall:
    """The state of one call: what the recompute starts from, and the copies made for it."""

    def __init__(
        self, inner: Callable[..., Any], module: nn.Module, mode: CheckpointMode, args: Any, kwargs: Any
    ) -> None:
        self.inner, self.module, self.selective = inner, module, mode == "selective"
        self.call: tuple[Any, Any] | None = (args, kwargs)  # the forward runs on the caller's objects
        self.leaves, self.spec = tree_flatten((args, kwargs))  # the recompute's: copied containers
        self.versions = {i: x._version for i, x in enumerate(self.leaves) if isinstance(x, torch.Tensor)}
        self.inputs: dict[int, list[int]] = defaultdict(list)  # storage -> indices of input leaves
        for i in self.versions:
            st = _storage(self.leaves[i])
            if st is not None:
                self.inputs[st].append(i)
        self.copied: dict[int, bool] = {}  # leaf index -> whether the original required grad
        self.kept: dict[_Key, Any] = {}  # (op, n-th call of op) -> outputs selective keeps
        self.kept_at: dict[int, list[_Key]] = defaultdict(list)  # storage -> kept outputs in it
        self.kept_versions: dict[_Key, list[int]] = {}
        self.cow: dict[_Key, Any] = {}  # kept outputs copied before an in-place op wrote to them

    def __call__(self, *anchor: torch.Tensor) -> Any:
        if self.call is not None:  # the forward
            args, kwargs = self.call
            self.call = None
            return self.inner(*args, **kwargs)
        args, kwargs = tree_unflatten(self.leaves, self.spec)  # the recompute
        return self.inner(*args, **kwargs)

    def before_write(self, t: torch.Tensor) -> None:
        """Called just before an op writes into ``t``: copy what the recompute will need."""
        st = _storage(t)
        if st is None:
            return
        with torch.no_grad():
            for i in self.inputs.pop(st, ()):
                self.copied[i] = self.leaves[i].requires_grad
                self.leaves[i] = self.leaves[i].clone()
                _COPIES.setdefault(self.module, set()).add("its input")
            for key in self.kept_at.pop(st, ()):
                if key not in self.cow:
                    self.cow[key] = tree_map(
                        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, self.kept[key]
                    )
                    op = getattr(key[0], "overloadpacket", key[0])
                    what = f"the output of {getattr(op, '__name__', op)} that selective checkpointing keeps"
                    _COPIES.setdefault(self.module, set()).add(what)

    def keep(self, key: _Key, out: Any) -> None:
        """Selective checkpointing keeps ``out``: watch its storage for in-place writes."""
        tensors = _tensors(out)
        self.kept[key] = out
        self.kept_versions[key] = [x._version for x in tensors]
        for x in tensors:
            st = _storage(x)
            if st is not None:
                self.kept_at[st].append(key)

    def after_forward(self) -> None:
        # The watch's references are no longer needed (SAC holds what it keeps).
        self.kept.clear()
        self.kept_at.clear()
        self.inputs.clear()

    def before_recompute(self) -> None:
        """Check no input changed since the forward; give copies of grad-requiring inputs a graph."""
        for i, version in self.versions.items():
            if i not in self.copied and self.leaves[i]._version != version:
                raise CheckpointError(
                    f"an input of the checkpointed block {type(self.module).__name__} was "
                    "modified in place after the block's forward returned, so its recompute would "
                    "start from different values; do not checkpoint this block (mode 'none')."
                )
        # Note [grad-requiring copies]
        # This runs under the recompute's enable_grad, before the selective-checkpoint replay
        # mode is entered (it must not count this clone as one of the block's ops). An in-place
        # op on a leaf that requires grad is an error, hence a non-leaf copy.
        for i, requires_grad in self.copied.items():
            if requires_grad:
                self.leaves[i] = self.leaves[i].detach().requires_grad_(True).clone()

    def replayed(self, key: _Key, out: Any) -> Any:
        """What the recompute's op ``key`` returns: the copy-on-write copy, or SAC's checked output."""
        if key in self.cow:
            return self.cow.pop(key)
        versions = self.kept_versions.get(key)
        if versions is not None and versions != [x._version for x in _tensors(out)]:
            raise CheckpointError(
                f"an output that selective checkpointing keeps in {type(self.module).__name__} "
                "was modified in place after the block's forward returned; use mode 'full' for this block."
            )
        return out


class _Watch(TorchDispatchMode):
    """Forward: before every in-place write, let the call copy what the recompute needs."""

    def __init__(self, call: _BlockCall) -> None:
        super().__init__()
        self.call = call
        self.count: dict[Any, int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        call = self.call
        if call.inputs or call.kept_at:
            for t in _written(func, args, kwargs):
                call.before_write(t)
        out = func(*args, **kwargs)
        if call.selective and func not in _IGNORED:
            n = self.count[func]
            self.count[func] = n + 1
            if selective_saves(func):
                call.keep((func, n), out)
        return out


class _Replay(TorchDispatchMode):
    """Recompute (selective): hand each op the copy-on-write copy of its kept output, if any."""

    def __init__(self, call: _BlockCall) -> None:
        super().__init__()
        self.call = call
        self.count: dict[Any, int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _IGNORED:
            return out
        n = self.count[func]
        self.count[func] = n + 1
        return self.call.replayed((func, n), out)


def run_checkpointed(
    inner: Callable[..., Any],
    module: nn.Module,
    mode: CheckpointMode,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run ``inner(*args, **kwargs)`` (the block's forward) under non-reentrant checkpointing.

    Args:
        inner: the block's own forward.
        module: the block (its BatchNorm statistics are restored after the recompute).
        mode: ``"full"`` or ``"selective"``.
        args, kwargs: the call's arguments.

    Returns:
        What the block's forward returns.
    """
    if torch.compiler.is_compiling():
        return _ckpt.checkpoint(
            inner, *args, use_reentrant=False, preserve_rng_state=True, **compiled_contexts(mode), **kwargs
        )
    call = _BlockCall(inner, module, mode, args, kwargs)
    device = next((t.device for t in _tensors((args, kwargs))), None)
    if device is None:
        device = model_device(module)
    # The inputs reach the recompute through ``call``, not through checkpoint's own arguments
    # (it would refuse inputs the block itself overwrote). An empty tensor on the inputs'
    # device still tells checkpoint which device's RNG and autocast state to replay.
    # See Note [what a recompute replays]
    anchor = torch.empty(0, device=device)
    return _ckpt.checkpoint(
        call,
        anchor,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=functools.partial(_contexts, call),
    )


def _contexts(call: _BlockCall) -> tuple[Any, Any]:
    """``context_fn``: PyTorch enters the first context around the forward and the second
    around the recompute in backward (with the forward's RNG and autocast state restored).
    """
    # Dispatch modes stack: the one entered last sees each op first, and what it passes on
    # (``func(*args)``) reaches the next one down.
    #   forward    _Watch, then SAC's caching mode (selective only): SAC decides what to keep
    #              and passes every op down to the watch, which sees them in SAC's order,
    #              copies what an in-place op is about to overwrite, and whose copies SAC
    #              never sees (nor counts).
    #   recompute  the version check and grad-requiring copies (before any mode), BatchNorm
    #              statistics put back afterwards, SAC's cached mode, then _Replay on top: it
    #              sees each op first and swaps a copy-on-write copy in for what SAC returns.
    # Full checkpointing uses the same contexts without the SAC modes and _Replay.
    # See Note [grad-requiring copies]
    if not call.selective:
        return _forward(call, None), _Reentrant(functools.partial(_recompute, call, None))
    caching, cached = _ckpt.create_selective_checkpoint_contexts(
        selective_policy, allow_cache_entry_mutation=True
    )
    return _forward(call, caching), _Reentrant(functools.partial(_recompute, call, cached))


class _Reentrant:
    """A context entered once per recompute: a graph kept with ``retain_graph`` (the fused
    optimizer step's clipping, :mod:`memfit.levers.fused`) runs its backward, and so the
    block's recompute, twice; a generator's context can be entered once only."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._open: list[Any] = []

    def __enter__(self) -> Any:
        self._open.append(self._make())
        return self._open[-1].__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._open.pop().__exit__(*exc)


@contextlib.contextmanager
def _forward(call: _BlockCall, caching: Any) -> Iterator[None]:
    with _Watch(call), caching if caching is not None else contextlib.nullcontext():
        yield
    call.after_forward()


@contextlib.contextmanager
def _recompute(call: _BlockCall, cached: Any) -> Iterator[None]:
    call.before_recompute()
    with keep_running_stats(call.module):
        if cached is None:
            yield
        else:
            with cached, _Replay(call):
                yield
