"""Every use of PyTorch's private memory-tracker internals, in one module.

memfit counts bytes with ``torch.distributed._tools.mem_tracker.MemTracker`` (and
``FSDPMemTracker`` for FSDP2 models): exact, repeatable counts by category on any device,
real or fake tensors. Reading phases and per-block numbers out of it needs some of its
private names (snapshot keys, module states, the storage walk). They are all here, so a
PyTorch upgrade that moves them breaks one file, and the rest of memfit talks to the
tracker through :class:`MemoryWatch`, :class:`PhaseTracker`, :func:`breakdown_of` and
:func:`block_memory`.

Trade-off: subclassing a private class is brittle across PyTorch releases; the tests of
measure, profile and estimate exercise every method here on each upgrade, and the pinned
torch in requirements-dev.txt is the version they were checked against.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 4)
    >>> with MemoryWatch(model) as watch:
    ...     model(torch.randn(2, 4)).sum().backward()
    >>> watch.peak_bytes == sum(watch.breakdown.values()) > 0
    True
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _ModState

__all__ = [
    "BlockMemory",
    "MemoryWatch",
    "PhaseTracker",
    "block_memory",
    "breakdown_of",
    "device_of",
    "fsdp_breakdown_of",
    "ignore_frozen_parameters",
    "is_fsdp",
]

#: Owners of storages the forward creates outside every block: before the first, after the last.
OUTSIDE_BEFORE, OUTSIDE_AFTER = "<outside before>", "<outside after>"


def breakdown_of(snapshot: dict[Any, int]) -> dict[str, int]:
    """Map MemTracker's categories onto memfit's breakdown keys."""
    get = snapshot.get
    return {
        "params": get(_MemRefType.PARAM, 0) + get(_MemRefType.BUFFER, 0),
        "grads": get(_MemRefType.GRAD, 0),
        "optimizer": get(_MemRefType.OPT, 0),
        "activations": get(_MemRefType.ACT, 0),
        "temporaries": get(_MemRefType.TEMP, 0) + get(_MemRefType.OTH, 0),
    }


def fsdp_breakdown_of(snapshot: dict[Any, int]) -> dict[str, int]:
    """Map FSDPMemTracker's categories (sharded, unsharded, collectives) onto the breakdown."""
    by = {getattr(k, "name", str(k)): v for k, v in snapshot.items()}
    get = by.get
    return {
        "params": get("SHARDED_PARAM", 0)
        + get("UNSHARDED_PARAM", 0)
        + get("BUFFER", 0)
        + get("ALL_GATHER", 0),
        "grads": get("SHARDED_GRAD", 0) + get("UNSHARDED_GRAD", 0) + get("REDUCE_SCATTER", 0),
        "optimizer": get("OPT", 0),
        "activations": get("ACT", 0) + get("INP", 0),
        "temporaries": get("TEMP", 0) + get("OTH", 0),
    }


def is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


class _NoHook:
    def remove(self) -> None:
        pass


def ignore_frozen_parameters(tracker: MemTracker, model: nn.Module) -> None:
    """Let ``tracker`` watch a model with frozen parameters (Whisper's position embeddings).

    # NOTE: MemTracker hooks every parameter's gradient, which PyTorch refuses for a frozen
    # one; marked as hooked already (handles that remove nothing), they still count.
    """
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())


def device_of(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


class MemoryWatch:
    """Context that tracks the memory of the training step run inside it.

    MemTracker gives the breakdown on every device; on a GPU the CUDA allocator's peak is
    the total. Tracking only observes: the step computes exactly what it would untracked.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 4)
        >>> with MemoryWatch(model) as watch:
        ...     model(torch.randn(2, 4)).sum().backward()
        >>> watch.peak_bytes == sum(watch.breakdown.values()) > 0
        True
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self._hook: Any = None
        self.device = device_of(model)
        self.peak_bytes = 0
        self.breakdown: dict[str, int] = {}
        self._parts = breakdown_of
        if is_fsdp(model):
            # NOTE: an FSDP2 model's parameters are DTensors; FSDPMemTracker counts this rank's
            # shards plus the unsharded parameters and gradients of the block computing.
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            self._tracker: MemTracker = FSDPMemTracker(model, optimizer)
            self._parts = fsdp_breakdown_of
        else:
            # NOTE: a PhaseTracker outside any phase is a MemTracker with a linear-time peak
            # update (MemTracker's own visits every module it has seen, for every op).
            self._tracker = PhaseTracker(self.device, {}, {})
            modules: list[Any] = [model] + ([optimizer] if optimizer is not None else [])
            self._tracker.track_external(*modules)
            ignore_frozen_parameters(self._tracker, model)

    def current(self) -> dict[str, int]:
        """The breakdown of what is held now (call inside the context)."""
        return self._parts(self._tracker.get_tracker_snapshot("current").get(self.device, {}))

    def __enter__(self) -> MemoryWatch:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        # NOTE: registered before MemTracker's own global hooks so it runs first.
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._next_micro_batch)
        self._tracker.__enter__()
        return self

    def _next_micro_batch(self, module: nn.Module, args: Any) -> None:
        # NOTE: MemTracker refuses a second forward of the root module in one context (it
        # takes it for a new iteration). With gradient accumulation that second forward is
        # the next micro-batch of the same step: clear the per-module statistics (the
        # peak snapshot is kept) so it is tracked like the first.
        tracker = self._tracker
        if module is self.model and module in tracker.memory_tracking and not tracker._mod_tracker.is_bw:
            tracker.reset_mod_stats()

    def __exit__(self, *exc: object) -> None:
        self._tracker.__exit__(*exc)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.breakdown = self._parts(self._tracker.get_tracker_snapshot("peak").get(self.device, {}))
        self.peak_bytes = sum(self.breakdown.values())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # NOTE: on a GPU the allocator's peak is the truth: it also counts what MemTracker
            # does not see (the batch, cuBLAS workspaces); the difference goes to temporaries.
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            self.breakdown["temporaries"] += self.peak_bytes - sum(self.breakdown.values())


@dataclass
class BlockMemory:
    """Tracker totals (bytes, all categories) at the moments one block starts and ends."""

    name: str
    forward_start: int = 0
    """Total when the block's forward starts."""
    forward_end: int = 0
    """Total when the block's forward returns."""
    forward_peak: int = 0
    """Highest total while the block's forward runs."""
    backward_start: int = 0
    """Total when the gradient of the block's output is ready (its backward starts)."""
    backward_grads: int = 0
    """Bytes of parameter gradients that exist when the block's backward starts."""
    backward_peak: int = 0
    """Highest total while the block's backward runs (recompute included)."""


class PhaseTracker(MemTracker):
    """MemTracker with phase peaks, outside-of-block peaks and a faster peak update."""

    def __init__(self, device: torch.device, blocks: dict[int, str], grads: dict[str, int]) -> None:
        super().__init__()
        self.device = device
        self.phase = "idle"
        self.phase_peak: dict[str, int] = {}
        self.phase_snap: dict[str, dict[Any, int]] = {}
        self.kept = 0
        self.outside_peak: dict[str, int] = {"forward": 0, "backward": 0, "after blocks": 0}
        self._blocks = blocks  # id(module) -> block name
        self._grads = grads  # block name -> grad bytes
        self._block_fqns: set[str] = set()
        self._saved: dict[str, int] = {}
        self._start = 0
        self._stats: dict[str, Any] = {}
        self._fqn_names: dict[str, str] = {}
        self._owner: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._blocks_done = 0
        self._before: weakref.WeakSet[Any] = weakref.WeakSet()
        self.saved_alive: dict[str, int] = {}

    def total(self) -> int:
        return int(self._curr_mem_snap.get(self.device, {}).get(_TOTAL_KEY, 0))

    def current_parts(self) -> dict[str, int]:
        return breakdown_of(self._curr_mem_snap.get(self.device, {}))

    def grads_now(self) -> int:
        return int(self._curr_mem_snap.get(self.device, {}).get(_MemRefType.GRAD, 0))

    def enter_phase(self, phase: str) -> None:
        self.phase = phase
        self.phase_peak[phase] = self.total()
        self.phase_snap[phase] = dict(self._curr_mem_snap.get(self.device, {}))
        if phase == "forward":
            self.kept = self._start = self.total()
            # parameters, buffers, optimizer state: never owned by a part of the forward
            self._before = weakref.WeakSet(winfo for winfo, _ in self._WINFO.values())

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        super()._pre_fw_hook(module, inputs)
        stats = self.memory_tracking[module]
        self._stats[stats.mod_fqn] = stats
        if id(module) in self._blocks:
            self._block_fqns.add(stats.mod_fqn)
            self._fqn_names[stats.mod_fqn] = self._blocks[id(module)]

    def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        super()._post_fw_hook(module, inputs, outputs)
        name = self._blocks.get(id(module))
        if name is not None and not self._mod_tracker.is_bw and name not in self._saved:
            snaps = self.memory_tracking[module].snapshots
            saved = _tot(snaps[_ModState.POST_FW][0], self.device) - _tot(
                snaps[_ModState.PRE_FW][0], self.device
            )
            self._saved[name] = saved
            self.kept += saved
            self._blocks_done += 1

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        super()._track(reftype, t)
        if self.phase != "forward":
            return
        # NOTE: every storage the forward creates is owned by the block running then, or by
        # the outside (before / after the last block); what is still alive when the forward
        # ends is what each part keeps for backward.
        active = self._block_fqns & self._mod_tracker.parents
        if active:
            owner = self._fqn_names[max(active, key=len)]
        else:
            owner = (
                OUTSIDE_AFTER if self._blocks and self._blocks_done >= len(self._blocks) else OUTSIDE_BEFORE
            )
        for st in get_untyped_storages(t):
            winfo = self._WINFO.get(st, (None, None))[0]
            if winfo is not None and winfo not in self._owner and winfo not in self._before:
                self._owner[winfo] = owner

    def close_forward(self) -> None:
        """At the end of the forward: what each part keeps; backward bookkeeping starts from it."""
        alive: dict[str, int] = {}
        for winfo, owner in list(self._owner.items()):
            alive[owner] = alive.get(owner, 0) + int(winfo.mem_consumed)
        self.saved_alive = alive
        for name in self._saved:
            self._saved[name] = alive.get(name, 0)
        self.kept = self._start + sum(self._saved.values())

    def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
        super()._post_bw_hook(module, args)
        name = self._blocks.get(id(module)) if module is not None else None
        if name is not None and name in self._saved:
            self.kept += self._grads[name] - self._saved.pop(name)

    def _update_peak_stats(self, peak_state: Any) -> None:
        # NOTE: same updates as MemTracker._update_peak_stats, but only for the modules
        # that are running now (looked up by name) instead of every module ever seen. A
        # snapshot is a flat {category: bytes} dict: dict() copies it (deepcopy was slow).
        curr = self._curr_mem_snap
        parents = self._mod_tracker.parents
        for fqn in parents:
            stats = self._stats.get(fqn)
            if stats is None or peak_state not in stats.snapshots:
                continue
            for dev, dev_snap in curr.items():
                if stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                    stats.snapshots[peak_state][-1][dev] = dict(dev_snap)
        for dev, dev_snap in curr.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(dev_snap)
        total = self.total()
        phase = self.phase
        if phase in self.phase_peak and total > self.phase_peak[phase]:
            self.phase_peak[phase] = total
            self.phase_snap[phase] = dict(curr.get(self.device, {}))
        if phase in self.outside_peak and not (self._block_fqns & parents):
            # NOTE: once every block's backward is done, the part before the blocks (stem,
            # embeddings) runs its backward with every block's gradient held: its own event.
            after = phase == "backward" and self._blocks_done > 0 and not self._saved
            bucket = "after blocks" if after else phase
            self.outside_peak[bucket] = max(self.outside_peak[bucket], total - self.kept)


def _tot(snapshot: dict[Any, dict[Any, int]], device: torch.device) -> int:
    return int(snapshot.get(device, {}).get(_TOTAL_KEY, 0))


def block_memory(tracker: PhaseTracker, name: str, module: nn.Module) -> BlockMemory:
    stats = tracker.memory_tracking.get(module)
    out = BlockMemory(name=name)
    if stats is None:
        return out
    snaps = stats.snapshots
    dev = tracker.device

    def first(state: Any) -> dict[Any, dict[Any, int]]:
        return snaps[state][0] if snaps.get(state) else {}

    out.forward_start = _tot(first(_ModState.PRE_FW), dev)
    out.forward_end = _tot(first(_ModState.POST_FW), dev)
    out.forward_peak = max(_tot(first(_ModState.PEAK_FW), dev), out.forward_end)
    out.backward_start = _tot(first(_ModState.PRE_BW), dev)
    out.backward_grads = int(first(_ModState.PRE_BW).get(dev, {}).get(_MemRefType.GRAD, 0))
    out.backward_peak = max(_tot(first(_ModState.PEAK_BW), dev), out.backward_start)
    return out
