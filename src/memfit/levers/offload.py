"""Activations of chosen blocks moved to host memory as the forward passes them (the ``offload`` lever).

What a chosen block keeps for its backward (a checkpointed block: its inputs, See Note
[inputs kept through autograd] in :mod:`memfit.checkpointing.recompute`; a block that is not
checkpointed: every tensor it saves) is copied to pinned host memory on a side stream as it is
saved, and the device copy is let go once the next offloaded block's forward has ended; in the
backward, the first use of a block's tensors brings the block before it back on the side
stream (a prefetch, one block ahead), so its copies overlap this block's backward (See Note
[the offload schedule]). On CUDA: pinned memory, a copy stream, events. On a CPU the same
schedule runs with the copies going to a second CPU tensor (values and order can be tested;
nothing is freed, so :mod:`memfit.applying.offload` refuses the lever there).

Trade-off: the device no longer holds the offloaded blocks' activations between their
forward and their backward, for two copies over the host link (hidden behind compute when
the link is fast enough: :mod:`memfit.stepmodel.offload` prices both) and pinned host
memory of the same size.

Example:
    >>> import torch
    >>> from memfit.models.llama import llama
    >>> model = llama(preset="tiny", n_layer=3).model
    >>> off = offload_blocks(model, ["blocks.0", "blocks.1", "blocks.2"], record=True)
    >>> x = torch.randint(0, 256, (2, 16))
    >>> model(x, x).backward()
    >>> [f"{e} {b}" for e, b, _ in off.log if e != "use"]  # doctest: +NORMALIZE_WHITESPACE
    ['offload blocks.0', 'offload blocks.1', 'release blocks.0', 'offload blocks.2',
     'release blocks.1', 'keep blocks.2', 'prefetch blocks.1', 'prefetch blocks.0']
    >>> off.moved_to_host > 0, off.host_bytes
    (True, 0)
    >>> clear_offload(model); offloaded_blocks(model)
    []
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes

from memfit.checkpointing.policy import selective_contexts
from memfit.devices import model_device

__all__ = [
    "MIN_OFFLOAD_BYTES",
    "ActivationOffloader",
    "clear_offload",
    "offload_blocks",
    "offloaded_blocks",
    "offloader_of",
    "selective_kept_offloaded",
]


#: Tensors smaller than this stay on the device (a copy costs more than it frees).
MIN_OFFLOAD_BYTES = 1024

# Note [the offload schedule]
# Forward: each offloaded block's call is one group. Every tensor it saves (through autograd's
# saved-tensor hooks) that is worth moving (at least MIN_OFFLOAD_BYTES, a plain tensor on the
# device, not a storage of the block's parameters or buffers or of the model's buffers, not a
# storage an earlier group moved) starts its copy to host memory at once; a view saved by two
# ops is moved once. The group's device copies are kept until the next offloaded block's
# forward ends, then (the copies waited for) let go: while block k+1 runs, block k's copy runs
# beside it. The last group is never let go: its backward comes first, right after the head.
# Backward: the first tensor of a group asked for brings the whole group back (unless still on
# the device) and starts bringing back the group before it (the prefetch): its copy runs while
# this group's backward runs. Once every saved tensor an item stands for has been handed back,
# the offloader holds its device copy no longer (asked for again, by a retained graph's second
# backward, it is copied again); the host copy lives as long as autograd's saved tensor; a
# device copy the caller changed in place after the forward is not used (the host copy holds
# what was saved). On CUDA the copies run on one side stream: to the host after the main
# stream's work so far (the tensor is made), back to the device into memory of the side stream
# that the main stream waits for (an event) and marks as used (record_stream) before using it.
# memfit.stepmodel.offload prices exactly this schedule.


@dataclass(eq=False)
class _Item:
    """One saved tensor moved to host memory."""

    group: _Group
    host: torch.Tensor
    device: torch.device
    requires_grad: bool
    on_device: torch.Tensor | None
    event: Any = None
    """The copy's CUDA event (None: done, or a CPU copy)."""
    version: int = 0
    """The tensor's version when saved: a device copy changed in place since is not used."""
    saves: int = 1
    """Saved tensors it stands for (one tensor saved by two ops is moved once)."""
    uses: int = 0
    """Times the backward asked for it."""

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


@dataclass(eq=False)
class _Group:
    """One offloaded block's call: what it saved, in order."""

    block: str
    index: int
    items: list[weakref.ref[_Item]] = field(default_factory=list)
    """Weak: autograd holds the items (and each its group), so none outlives its saved tensor."""
    views: dict[tuple[Any, ...], weakref.ref[_Item]] = field(default_factory=dict)
    """The item of each view saved (a tensor saved by two ops is moved once, one item for both)."""
    released: bool = False
    fetched: bool = False
    """Brought back (all its items) once in this backward."""


# Note [the host on a CPU]
# On a CPU the schedule runs as on CUDA with the copies going to a second CPU tensor, at once.
# That "host" copy is made with the dispatch modes set aside, so a memory tracker around the
# step (MemTracker, memfit.measuring.tracker) does not count it, as a GPU's allocator does not
# count pinned host memory: what it measures is the device's side of the schedule, which
# memfit.stepmodel.offload predicts (tests/test_offload.py). The copy back to the "device" is
# counted. Nothing is freed for real (both copies are in the same memory), which is why
# memfit.applying.offload refuses the lever on a CPU; the offloader counts the host bytes itself.


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its span without gaps or overlaps (in some order of dims)."""
    expected = 1
    for size, stride in sorted(
        (d for d in zip(t.shape, t.stride(), strict=True) if d[0] != 1), key=lambda d: d[1]
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _host_like(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """An empty host tensor for ``t``'s values, in ``t``'s layout where it is dense.

    See Note [the layout of a copy].
    """
    if _dense(t):
        return torch.empty_like(t, device="cpu", pin_memory=pin)
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)


# Note [the layout of a copy]
# A copy keeps the strides of what it copies (a dense tensor: empty_like; brought back:
# clone and .to, which keep a dense tensor's layout), because a recompute replays ops whose
# count can depend on the layout: ``y.transpose(1, 2).contiguous()`` after attention copies
# or not depending on the attention output's strides, and selective checkpointing, which
# hands the recompute the kept output as it comes back, refuses a recompute with an op the
# forward did not run. A view with gaps (a slice of a larger tensor) is copied compact, its
# layout lost: torch's own save_on_cpu copies everything compact.


class _CpuLink:
    """Copies into a second CPU tensor, at once (See Note [the host on a CPU])."""

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if is_fake(t):
            return t.clone(), None
        with _disable_current_modes():
            host = _host_like(t, pin=False)
            host.copy_(t)
        return host, None

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        return host.clone(), None  # a new tensor (version 0), as a copy from the host is

    def wait(self, event: Any, t: torch.Tensor | None) -> None:
        return None


class _CudaLink:
    """Pinned host memory, one copy stream, events (See Note [the offload schedule])."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        host = _host_like(t, pin=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            return host, self.stream.record_event()

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        with torch.cuda.stream(self.stream):
            out = host.to(device, non_blocking=True)  # new (version 0), the side stream's memory
            return out, self.stream.record_event()

    def wait(self, event: Any, t: torch.Tensor | None) -> None:
        if event is None:
            return
        main = torch.cuda.current_stream(t.device if t is not None else None)
        main.wait_event(event)
        if t is not None:
            t.record_stream(main)


class ActivationOffloader:
    """Moves what the offloaded blocks of one model save to host memory and back (See Note
    [the offload schedule]); counts the bytes (and, with ``record``, logs each step of it).

    Attributes:
        host_bytes: bytes of host copies alive now; ``peak_host_bytes`` the most at once.
        moved_to_host, moved_to_device: bytes copied each way so far.
        log: with ``record``, ``(event, block, bytes)`` in the order they happened: ``offload``
            (a group's copies started; bytes so far), ``release`` (its device copies let go),
            ``keep`` (the last group, kept on the device), ``fetch`` (brought back when asked
            for), ``prefetch`` (brought back one block ahead), ``use`` (handed to autograd).
    """

    def __init__(
        self, device: torch.device, min_bytes: int = MIN_OFFLOAD_BYTES, record: bool = False
    ) -> None:
        self.device = device
        self.min_bytes, self.record = min_bytes, record
        self.link: _CpuLink | _CudaLink = _CudaLink(device) if device.type == "cuda" else _CpuLink()
        self.log: list[tuple[str, str, int]] = []
        self.host_bytes = self.peak_host_bytes = self.moved_to_host = self.moved_to_device = 0
        self._groups: dict[int, weakref.ref[_Group]] = {}
        self._pending: list[_Group] = []
        self._open: list[tuple[_Group | None, Any]] = []
        self._seen: dict[int, tuple[int, weakref.ref[torch.Tensor]]] = {}
        """Storage -> the group that moved a view of it, and that view (while alive)."""
        self._fixed: set[int] = set()
        self._next = 0
        self.root: weakref.ref[nn.Module] | None = None
        """The model, whose buffers (a rotary table the blocks read slices of) are never moved."""

    def __reduce__(self) -> Any:
        # a copied or unpickled model gets an offloader of its own, with nothing in flight
        return (ActivationOffloader, (self.device, self.min_bytes, self.record))

    def __deepcopy__(self, memo: dict[int, Any]) -> ActivationOffloader:
        return ActivationOffloader(self.device, self.min_bytes, self.record)

    def _note(self, event: str, group: _Group, nbytes: int) -> None:
        if self.record:
            self.log.append((event, group.block, nbytes))

    # the forward
    def begin(self, block: str, module: nn.Module) -> None:
        """An offloaded block's forward starts: what it saves goes through :meth:`pack`."""
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            self._open.append((None, None))  # no graph, or a recompute inside the backward
            return
        root = self.root() if self.root is not None else None
        self._fixed = _storages_of(module) | (_storages_of(root, params=False) if root is not None else set())
        self._groups = {i: r for i, r in self._groups.items() if r() is not None}
        self._seen = {k: v for k, v in self._seen.items() if v[1]() is not None}  # freed: reused
        group = _Group(block, self._next)
        self._next += 1
        self._groups[group.index] = weakref.ref(group)
        hooks = torch.autograd.graph.saved_tensors_hooks(functools.partial(self.pack, group), self.unpack)
        hooks.__enter__()
        self._open.append((group, hooks))

    def end(self) -> None:
        """The block's forward ended: earlier groups' device copies go; this one's wait."""
        group, hooks = self._open.pop()
        if group is None:
            return
        hooks.__exit__(None, None, None)
        for done in self._pending:
            self._release(done)
        self._pending = [group]

    def pack(self, group: _Group, t: torch.Tensor) -> Any:
        """A saved tensor: its copy to the host starts, or (not worth it) it stays as it is."""
        if not self._worth(t):
            return t
        view = (_storage(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        same = group.views.get(view)
        if same is not None and (shared := same()) is not None:
            shared.saves += 1
            return shared
        earlier = self._seen.get(view[0])
        if earlier is not None and earlier[0] != group.index and earlier[1]() is not None:
            return t  # a storage an earlier group moved: alive on the device for that one anyway
        self._seen[view[0]] = (group.index, weakref.ref(t))
        host, event = self.link.to_host(t)
        item = _Item(group, host, t.device, t.requires_grad, t, event, t._version)
        group.items.append(weakref.ref(item))
        group.views[view] = weakref.ref(item)
        self.moved_to_host += item.nbytes
        self.host_bytes += item.nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        weakref.finalize(item, self._host_freed, item.nbytes)
        if len(group.items) == 1:
            self._note("offload", group, item.nbytes)
        return item

    def _host_freed(self, nbytes: int) -> None:
        self.host_bytes -= nbytes

    def _worth(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor or t.device.type != self.device.type or t.is_sparse:
            return False
        if t.numel() * t.element_size() < self.min_bytes:
            return False
        return _storage(t) not in self._fixed

    def _release(self, group: _Group) -> None:
        nbytes = 0
        for item in _alive(group):
            if item.on_device is not None:
                self.link.wait(item.event, None)
                item.on_device, item.event = None, None
                nbytes += item.nbytes
        group.released = True
        self._note("release", group, nbytes)

    # the backward
    def unpack(self, x: Any) -> torch.Tensor:
        """A saved tensor asked for by the backward: on the device (brought back if it left)."""
        if not isinstance(x, _Item):
            return x
        group = x.group
        if self._pending:
            for kept in self._pending:
                self._note("keep", kept, sum(i.nbytes for i in _alive(kept)))
            self._pending = []
        if x.on_device is not None and x.on_device._version != x.version:
            x.on_device = None  # changed in place after its forward: the host copy is what it saved
        if x.on_device is None:
            self._fetch(group, "fetch", [x] if group.fetched else _alive(group))
        self._prefetch_before(group)
        t = x.on_device
        assert t is not None
        self.link.wait(x.event, t)
        x.event = None
        x.uses += 1
        if x.uses % x.saves == 0:  # every saved tensor it stands for has had it: let it go
            x.on_device = None
        self._note("use", group, x.nbytes)
        return t

    def _fetch(self, group: _Group, why: str, items: list[_Item]) -> None:
        group.fetched = True
        nbytes = 0
        for item in items:
            if item.on_device is None:
                item.on_device, item.event = self.link.to_device(item.host, item.device)
                item.version = item.on_device._version
                nbytes += item.nbytes
        self.moved_to_device += nbytes
        self._note(why, group, nbytes)

    def _prefetch_before(self, group: _Group) -> None:
        ref = self._groups.get(group.index - 1)
        before = ref() if ref is not None else None
        if before is not None and before.released and not before.fetched:
            self._fetch(before, "prefetch", _alive(before))


def _alive(group: _Group) -> list[_Item]:
    return [item for ref in group.items if (item := ref()) is not None]


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def _storages_of(module: nn.Module, params: bool = True) -> set[int]:
    out = set()
    for t in [*(module.parameters() if params else ()), *module.buffers()]:
        try:
            out.add(_storage(t))
        except (RuntimeError, NotImplementedError):  # fake or meta tensors: no storage to compare
            continue
    return out


def _begin(offloader: ActivationOffloader, block: str, module: nn.Module, args: Any) -> None:
    offloader.begin(block, module)


def _end(offloader: ActivationOffloader, module: nn.Module, args: Any, output: Any) -> None:
    offloader.end()


def _hooks(module: nn.Module) -> list[tuple[int, functools.partial[Any]]]:
    """The offload hooks on ``module``: (handle id, hook)."""
    found = [
        (k, h)
        for hooks in (module._forward_pre_hooks, module._forward_hooks)
        for k, h in hooks.items()
        if isinstance(h, functools.partial) and h.func in (_begin, _end)
    ]
    return found


def selective_kept_offloaded() -> bool:
    """Whether what selective checkpointing keeps goes through the offload hooks too: torch 2.14
    and newer, where memfit routes it so; before, selective blocks keep their matmul outputs on
    the device.

    See Note [selective checkpointing and saved-tensor hooks].
    """
    caching, _ = selective_contexts()
    return bool(getattr(caching, "respect_saved_tensors_hooks", False))


def offloader_of(model: nn.Module) -> ActivationOffloader | None:
    """The offloader of ``model``'s offloaded blocks (None: no block is offloaded)."""
    for module in model.modules():
        for _, hook in _hooks(module):
            return hook.args[0]
    return None


def offload_blocks(
    model: nn.Module,
    names: Sequence[str],
    *,
    min_bytes: int = MIN_OFFLOAD_BYTES,
    record: bool = False,
) -> ActivationOffloader:
    """Offload what the named blocks save (others are left as they are; replaces an earlier call).

    Args:
        model: the model (its blocks get forward hooks; its modules and state_dict do not change).
        names: qualified names of the blocks.
        min_bytes: smaller saved tensors stay on the device.
        record: keep a log of the schedule (:attr:`ActivationOffloader.log`).

    Returns:
        The offloader, which counts what it moved.
    """
    clear_offload(model)
    offloader = ActivationOffloader(model_device(model), min_bytes=min_bytes, record=record)
    offloader.root = weakref.ref(model)
    for name in names:
        block = model.get_submodule(name)
        block.register_forward_pre_hook(functools.partial(_begin, offloader, name))
        block.register_forward_hook(functools.partial(_end, offloader), always_call=True)
    return offloader


def clear_offload(model: nn.Module) -> None:
    """Offload no block of ``model``."""
    for module in model.modules():
        for key, _ in _hooks(module):
            module._forward_pre_hooks.pop(key, None)
            module._forward_hooks.pop(key, None)
            module._forward_hooks_always_called.pop(key, None)


def offloaded_blocks(model: nn.Module) -> list[str]:
    """Names of the blocks whose saved activations are offloaded."""
    return [n for n, m in model.named_modules() if any(h.func is _begin for _, h in _hooks(m))]
