"""One checkpointed call of a block: its forward now, and the recompute that backward runs.

memfit checkpoints a block with PyTorch's non-reentrant ``torch.utils.checkpoint``;
``selective`` adds PyTorch's selective-checkpoint (SAC) contexts. A recompute is right only
if it starts from what the forward started from and replays the same ops, however many
backwards run through the graph. Models written for speed break that in several ways, and
:func:`run_checkpointed` handles each:

- Argument containers the caller changes later (torchvision DenseNet appends each layer's
  output to the list every layer was given): the recompute gets containers copied at call
  time (lists, tuples, dicts, rebuilt around the same tensors).
- In-place ops on the block's own inputs (``x.relu_()`` as a block's first op): a watch
  sees every op of the forward and, just before one writes into an input's storage, copies
  that input once; the recompute starts from the copy. Inputs that share memory
  (``block(h, h)``) are copied together and stay aliased. Nothing is copied for a block
  that does not write to its inputs. See Note [a recompute per backward].
- In-place ops on an output selective checkpointing keeps (a convolution followed by an
  in-place activation, as in timm's EfficientNet and CoAtNet): just before the write, the
  watch copies the kept output (copy-on-write) and the recompute is handed the copy in its
  place. Only the outputs actually overwritten are copied.
- Buffers the forward writes (running statistics, counters): see
  :mod:`memfit.checkpointing.buffers`.

What the caller changes in place after the block returned cannot be seen; it is caught by a
version check when the recompute starts, with an error that names the block. Where a
recompute cannot be exact it refuses with a :class:`~memfit.errors.CheckpointError`.

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

from memfit.checkpointing.buffers import WrittenBuffers
from memfit.checkpointing.policy import compiled_contexts, selective_contexts, selective_saves
from memfit.checkpointing.writes import storage_key, written_by
from memfit.devices import model_device
from memfit.errors import CheckpointError
from memfit.vocab import CheckpointMode

__all__ = ["copies_made", "run_checkpointed"]

#: Ops SAC does not count (forward and recompute run different numbers of them).
_IGNORED: frozenset[Any] = frozenset(getattr(_ckpt, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default}))
_Key = tuple[Any, int]
#: What checkpointed calls of each block had to copy for their recompute (see copies_made).
_COPIES: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()

# Note [a recompute per backward]
# A graph backwarded more than once (``retain_graph=True``, two ``autograd.grad`` calls, two
# losses over one graph, the fused optimizer step's clipping) recomputes each checkpointed
# block once per backward, and every recompute must start from the same values. An input
# the forward wrote in place is copied just before the write (the pristine copy); a
# recompute writes into its own inputs again, so it is handed a fresh copy of the pristine
# one whenever the running backward keeps the graph (PyTorch's keep_graph flag: another
# backward may follow), and the pristine copy itself only when it is the last backward the
# graph allows, as before, so a single backward costs no more memory than it did. A later
# backward that still reaches the block after that (a partial backward without
# retain_graph=True, then another) would start from overwritten values: it refuses.
# Selective checkpointing keeps the outputs it saves for one backward only, as PyTorch does
# ("Trying to backward an extra time"); memfit raises a CheckpointError that names the block.


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


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _graph_kept() -> bool:
    """Whether the running backward keeps the graph (another one may follow); True outside one."""
    try:
        return bool(torch._C._autograd._get_current_graph_task_keep_graph())
    except (RuntimeError, AttributeError):  # no backward running (a saved tensor read directly)
        return True


def _aliased_copies(label: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One copy of the memory ``tensors`` share, and each of them as the same view of it."""
    if len({(t.dtype, t.device) for t in tensors}) > 1:
        raise CheckpointError(
            f"the checkpointed block {label} writes in place into inputs that share memory but differ "
            "in dtype or device, which memfit cannot copy together; do not checkpoint it (mode 'none')."
        )
    storage = tensors[0].untyped_storage().clone()
    return [
        torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.size(), t.stride())
        for t in tensors
    ]


def _aliased_working(pristine: list[torch.Tensor], grads: list[bool]) -> list[torch.Tensor]:
    """A recompute's own copy of aliased inputs, the grad-requiring ones with a graph.

    See Note [grad-requiring copies]
    """
    base = pristine[0]
    n = base.untyped_storage().nbytes() // base.element_size()
    root = torch.empty(0, dtype=base.dtype, device=base.device).set_(base.untyped_storage(), 0, (n,), (1,))
    work = root.detach().requires_grad_(True).clone() if any(grads) else root.clone()
    plain = work.detach()
    return [
        (work if g else plain).as_strided(t.size(), t.stride(), t.storage_offset())
        for t, g in zip(pristine, grads, strict=True)
    ]


class _BlockCall:
    """The state of one call: what the recompute starts from, and the copies made for it."""

    def __init__(
        self,
        inner: Callable[..., Any],
        module: nn.Module,
        mode: CheckpointMode,
        args: Any,
        kwargs: Any,
        label: str,
    ) -> None:
        self.inner, self.module, self.selective, self.label = inner, module, mode == "selective", label
        self.call: tuple[Any, Any] | None = (args, kwargs)  # the forward runs on the caller's objects
        self.leaves, self.spec = tree_flatten((args, kwargs))  # the recompute's: copied containers
        self.versions = {i: x._version for i, x in enumerate(self.leaves) if isinstance(x, torch.Tensor)}
        self.inputs: dict[int, list[int]] = defaultdict(list)  # storage -> indices of input leaves
        for i in self.versions:
            st = storage_key(self.leaves[i])
            if st is not None:
                self.inputs[st].append(i)
        self.copied: dict[int, bool] = {}  # leaf index -> whether the original required grad
        self.groups: list[list[int]] = []  # copied inputs, one list per storage written
        self.pristine: dict[int, int] = {}  # copied leaf -> its version while nothing wrote into it
        self.replay: list[Any] | None = None  # the leaves the running recompute starts from
        self.kept: dict[_Key, Any] = {}  # (op, n-th call of op) -> outputs selective keeps
        self.kept_at: dict[int, list[_Key]] = defaultdict(list)  # storage -> kept outputs in it
        self.kept_versions: dict[_Key, list[int]] = {}
        self.cow: dict[_Key, Any] = {}  # kept outputs copied before an in-place op wrote to them
        self.buffers = WrittenBuffers(module, label)

    def __call__(self, *anchor: torch.Tensor) -> Any:
        if self.call is not None:  # the forward
            args, kwargs = self.call
            self.call = None
            return self.inner(*args, **kwargs)
        args, kwargs = tree_unflatten(self.replay if self.replay is not None else self.leaves, self.spec)
        return self.inner(*args, **kwargs)

    def watching(self) -> bool:
        return bool(self.inputs or self.kept_at or self.buffers.storages)

    def before_write(self, t: torch.Tensor) -> None:
        """Called just before an op writes into ``t``: copy what the recompute will need."""
        st = storage_key(t)
        if st is None:
            return
        with torch.no_grad():
            found = self.inputs.pop(st, None)
            if found:
                self._copy_inputs(found)
            for key in self.kept_at.pop(st, ()):
                if key not in self.cow:
                    self.cow[key] = tree_map(
                        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, self.kept[key]
                    )
                    op = getattr(key[0], "overloadpacket", key[0])
                    what = f"the output of {getattr(op, '__name__', op)} that selective checkpointing keeps"
                    _COPIES.setdefault(self.module, set()).add(what)
        if self.buffers.storages:
            self.buffers.before_write(st)

    def _copy_inputs(self, found: list[int]) -> None:
        for i in found:
            self.copied[i] = self.leaves[i].requires_grad
        if len(found) == 1:
            self.leaves[found[0]] = self.leaves[found[0]].clone()
        else:
            copies = _aliased_copies(self.label, [self.leaves[i] for i in found])
            for i, c in zip(found, copies, strict=True):
                self.leaves[i] = c
        self.pristine.update({i: self.leaves[i]._version for i in found})
        self.groups.append(found)
        _COPIES.setdefault(self.module, set()).add("its input")

    def keep(self, key: _Key, out: Any) -> None:
        """Selective checkpointing keeps ``out``: watch its storage for in-place writes."""
        tensors = _tensors(out)
        self.kept[key] = out
        self.kept_versions[key] = [x._version for x in tensors]
        for x in tensors:
            st = storage_key(x)
            if st is not None:
                self.kept_at[st].append(key)

    def after_forward(self) -> None:
        # The watch's references are no longer needed (SAC holds what it keeps).
        self.kept.clear()
        self.kept_at.clear()
        self.inputs.clear()
        self.buffers.finish()

    def before_recompute(self) -> None:
        """Check no input changed since the forward; hand the recompute its own copies.

        See Note [a recompute per backward]
        """
        for i, version in self.versions.items():
            if i not in self.copied and self.leaves[i]._version != version:
                raise CheckpointError(
                    f"an input of the checkpointed block {self.label} was "
                    "modified in place after the block's forward returned, so its recompute would "
                    "start from different values; do not checkpoint this block (mode 'none')."
                )
        kept = _graph_kept()
        replay = list(self.leaves)
        for found in self.groups:
            if any(self.leaves[i]._version != self.pristine[i] for i in found):
                raise CheckpointError(
                    f"the checkpointed block {self.label} wrote into its input in place and an earlier "
                    "backward without retain_graph=True already recomputed it from that input, so this "
                    "backward cannot; pass retain_graph=True to every backward through it but the last."
                )
            for i, t in zip(found, self._working(found, kept), strict=True):
                replay[i] = t
            if not kept and len(found) == 1 and self.copied[found[0]]:
                i = found[0]
                self.leaves[i], self.pristine[i] = replay[i], replay[i]._version  # not needed again
        self.replay = replay

    def _working(self, found: list[int], kept: bool) -> list[torch.Tensor]:
        """The inputs one recompute starts from: copies of the pristine ones, or (the last
        backward) the pristine ones themselves.

        See Note [grad-requiring copies]
        """
        pristine = [self.leaves[i] for i in found]
        grads = [self.copied[i] for i in found]
        if len(found) > 1:
            return _aliased_working(pristine, grads) if kept or any(grads) else pristine
        if grads[0]:
            return [pristine[0].detach().requires_grad_(True).clone()]
        return [pristine[0].clone() if kept else pristine[0]]

    def replayed(self, key: _Key, out: Any) -> Any:
        """What the recompute's op ``key`` returns: the copy-on-write copy, or SAC's checked output."""
        if key in self.cow:
            return self.cow.pop(key)
        versions = self.kept_versions.get(key)
        if versions is not None and versions != [x._version for x in _tensors(out)]:
            raise CheckpointError(
                f"an output that selective checkpointing keeps in {self.label} "
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
        probes = None
        if call.watching():
            written = written_by(func, args, kwargs)
            probes = call.buffers.before_op(func, args, kwargs, written)
            for t in written:
                call.before_write(t)
        out = func(*args, **kwargs)
        if probes:
            call.buffers.after_probe(func, args, probes)
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
        try:
            out = func(*args, **(kwargs or {}))
        except RuntimeError as exc:
            if "backward an extra time" not in str(exc):
                raise
            raise CheckpointError(
                f"selective checkpointing of {self.call.label} keeps the outputs it saves for one backward "
                "only, and this backward runs through them again (a graph kept with retain_graph=True, or "
                "gradients taken with create_graph=True); use mode 'full' for this block."
            ) from exc
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
    label: str | None = None,
) -> Any:
    """Run ``inner(*args, **kwargs)`` (the block's forward) under non-reentrant checkpointing.

    Args:
        inner: the block's own forward.
        module: the block (the buffers it writes are put back after each recompute).
        mode: ``"full"`` or ``"selective"``.
        args, kwargs: the call's arguments.
        label: how errors name the block (default: its class name).

    Returns:
        What the block's forward returns.
    """
    if torch.compiler.is_compiling():
        return _ckpt.checkpoint(
            inner, *args, use_reentrant=False, preserve_rng_state=True, **compiled_contexts(mode), **kwargs
        )
    call = _BlockCall(inner, module, mode, args, kwargs, label or type(module).__name__)
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
    #   recompute  the version check and the recompute's own input copies (before any mode),
    #              written buffers started and put back around it, SAC's cached mode, then
    #              _Replay on top: it sees each op first and swaps a copy-on-write copy in for
    #              what SAC returns.
    # Full checkpointing uses the same contexts without the SAC modes and _Replay.
    # See Note [grad-requiring copies]
    if not call.selective:
        return _forward(call, None), _Reentrant(functools.partial(_recompute, call, None))
    caching, cached = selective_contexts(allow_cache_entry_mutation=True)
    return _forward(call, caching), _Reentrant(functools.partial(_recompute, call, cached))


class _Reentrant:
    """A context entered once per recompute: a graph backwarded more than once runs the
    block's recompute once per backward (see Note [a recompute per backward]); a generator's
    context can be entered once only."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._open: list[Any] = []

    def __enter__(self) -> Any:
        context = self._make()
        entered = context.__enter__()  # may refuse (a CheckpointError): then nothing stays open
        self._open.append(context)
        return entered

    def __exit__(self, *exc: Any) -> Any:
        return self._open.pop().__exit__(*exc)


@contextlib.contextmanager
def _forward(call: _BlockCall, caching: Any) -> Iterator[None]:
    with _Watch(call), caching if caching is not None else contextlib.nullcontext():
        yield
    call.after_forward()


@contextlib.contextmanager
def _recompute(call: _BlockCall, cached: Any) -> Iterator[None]:
    # Note [grad-requiring copies]
    # before_recompute runs under the recompute's enable_grad, before the selective-checkpoint
    # replay mode is entered (it must not count these clones as the block's ops). An in-place
    # op on a leaf that requires grad is an error, hence non-leaf copies; aliased inputs
    # become views (as_strided) of one such copy, so a write through one is seen by the other.
    call.before_recompute()
    try:
        with call.buffers.recompute():
            if cached is None:
                yield
            else:
                with cached, _Replay(call):
                    yield
    finally:
        call.replay = None
