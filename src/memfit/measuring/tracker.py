"""Every use of PyTorch's private memory-tracker internals, in one module.

memfit counts bytes with ``torch.distributed._tools.mem_tracker.MemTracker`` (and
``FSDPMemTracker`` for FSDP2 models): exact counts by category, real or fake tensors.
Phases and per-block numbers need its private names (snapshot keys, module states, the
storage walk, its hook handles); they are all here, so a PyTorch upgrade that moves them
breaks one file. The rest of memfit uses :class:`MemoryWatch`, :class:`PhaseTracker`,
:func:`breakdown_of` and :func:`block_memory`.

Trade-off: subclassing a private class is brittle across PyTorch releases; the tests of
measure, profile and estimate exercise every method here against the pinned torch.

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
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _ModState
from torch.utils._pytree import tree_flatten

from memfit.checkpointing.compile import eager
from memfit.devices import model_device, synchronize

__all__ = ["BlockMemory", "MemoryWatch", "PhaseTracker", "block_memory", "breakdown_of"]
__all__ += ["fsdp_breakdown_of", "is_fsdp"]

_NO_HOOK = SimpleNamespace(remove=lambda: None)  # a hook handle that removes nothing
#: Owners of storages the forward creates outside every block: before the first, after the last.
OUTSIDE_BEFORE, OUTSIDE_AFTER = "<outside before>", "<outside after>"

# Note [compiled code runs eagerly when tracked]
# torch.compile (torchao's optimizer step) refuses to run under a dispatch mode such as the
# tracker's, so every tracked step runs compiled code eagerly
# (memfit.checkpointing.compile.eager): what is measured is the eager step, its
# temporaries an upper bound of the compiled step's.


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
        "params": sum(get(k, 0) for k in ("SHARDED_PARAM", "UNSHARDED_PARAM", "BUFFER", "ALL_GATHER")),
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


class MemoryWatch:
    """Context that tracks the memory of the training step run inside it.

    MemTracker gives the breakdown on every device; on a GPU the CUDA allocator's peak is
    the total. Tracking only observes: the step computes exactly what it would untracked
    (the module docstring has an example).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model, self.device, self.peak_bytes, self._parts = model, model_device(model), 0, breakdown_of
        self._hook: Any = None
        self._eager: Any = None
        self.breakdown: dict[str, int] = {}
        if is_fsdp(model):
            # an FSDP2 model's parameters are DTensors; FSDPMemTracker counts this rank's
            # shards plus the unsharded parameters and gradients of the block computing.
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            self._tracker: MemTracker = FSDPMemTracker(model, optimizer)
            self._parts = fsdp_breakdown_of
        else:
            # PhaseTracker's peak update visits only the running modules: the same numbers, faster
            self._tracker = PhaseTracker(self.device, {}, {})
            self._tracker.track_external(*([model] + ([optimizer] if optimizer is not None else [])))

    def current(self) -> dict[str, int]:
        """The breakdown of what is held now (call inside the context)."""
        return self._parts(self._tracker.get_tracker_snapshot("current").get(self.device, {}))

    def __enter__(self) -> MemoryWatch:
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        # registered before MemTracker's own global hooks so it runs first;
        # see Note [compiled code runs eagerly when tracked]
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._next_micro_batch)
        self._eager = eager()
        self._eager.__enter__()
        self._tracker.__enter__()
        return self

    def _next_micro_batch(self, module: nn.Module, args: Any) -> None:
        # MemTracker refuses a second forward of the root module in one context (a new
        # iteration, it thinks); with gradient accumulation it is the next micro-batch of the
        # same step: clear the per-module statistics (the peak is kept) to track it the same.
        tracker = self._tracker
        if module is self.model and module in tracker.memory_tracking and not tracker._mod_tracker.is_bw:
            tracker.reset_mod_stats()

    def __exit__(self, *exc: object) -> None:
        self._tracker.__exit__(*exc)
        self._eager.__exit__(*exc)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.breakdown = self._parts(self._tracker.get_tracker_snapshot("peak").get(self.device, {}))
        self.peak_bytes = sum(self.breakdown.values())
        synchronize(self.device)
        if self.device.type == "cuda":
            # On a GPU the allocator's peak is the truth: it also counts what MemTracker
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
        # The outside's peaks before the first block (stem) and after it (head, loss) are
        # apart: the stem runs with no block's activations held (forward) or kept (backward).
        self.outside_peak = dict.fromkeys(("forward", "backward", "forward_before", "backward_before"), 0)
        self.ops: dict[str, int] = {}  # per part (block or outside key): aten ops of its forward
        self.allocated: dict[str, int] = {}  # per part: bytes of the storages its forward created
        self.output_bytes: dict[str, int] = {}  # per block: its output's bytes alive at the forward's end
        self._outputs: dict[str, list[weakref.ref[Any]]] = {}  # weak: freed outputs leave _owner
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
        self._stem: weakref.WeakSet[Any] = weakref.WeakSet()  # made before the first block ran
        self.saved_alive: dict[str, int] = {}
        self.stem_alive = 0
        """Bytes the stem made before the first block started, alive when the forward ends."""
        #: (phase, total) after every tracked operation, when a list (None: not recorded)
        self.timeline: list[tuple[str, int]] | None = None

    def track_external(self, *external: Any) -> None:
        super().track_external(*external)
        # MemTracker hooks every parameter's gradient, which PyTorch refuses for a frozen
        # one (Whisper's position embeddings): marked as hooked already, they still count.
        for m in (m for m in external if isinstance(m, nn.Module)):
            for p in (p for p in m.parameters() if not p.requires_grad):
                self._param_to_grad_hook_handles[p] = (_NO_HOOK, _NO_HOOK)

    def total(self) -> int:
        return int(self._curr_mem_snap.get(self.device, {}).get(_TOTAL_KEY, 0))

    def current_parts(self) -> dict[str, int]:
        return breakdown_of(self._curr_mem_snap.get(self.device, {}))

    def enter_phase(self, phase: str) -> None:
        self.phase = phase
        self.phase_peak[phase] = self.total()
        if self.timeline is not None:
            self.timeline.append((phase, self.phase_peak[phase]))
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
            pre, post = snaps[_ModState.PRE_FW][0], snaps[_ModState.POST_FW][0]
            saved = _tot(post, self.device) - _tot(pre, self.device)
            self._saved[name] = saved
            self.kept += saved
            self._blocks_done += 1
            self._outputs[name] = [
                weakref.ref(self._WINFO[st][0]) for st in _storages(outputs) if st in self._WINFO
            ]

    def _owner_now(self) -> str:
        active = self._block_fqns & self._mod_tracker.parents
        if active:
            return self._fqn_names[max(active, key=len)]
        return OUTSIDE_AFTER if self._blocks and self._blocks_done >= len(self._blocks) else OUTSIDE_BEFORE

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        res = super().__torch_dispatch__(func, types, args, kwargs)
        if self.phase == "forward":
            owner = self._owner_now()
            self.ops[owner] = self.ops.get(owner, 0) + 1
        return res

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        super()._track(reftype, t)
        if self.phase != "forward":
            return
        # Every storage the forward creates is owned by the block running then, or by the
        # outside (before / after the blocks); what is alive when the forward ends is kept.
        owner = self._owner_now()
        for st in get_untyped_storages(t):
            winfo = self._WINFO.get(st, (None, None))[0]
            if winfo is not None and winfo not in self._owner and winfo not in self._before:
                self._owner[winfo] = owner
                self.allocated[owner] = self.allocated.get(owner, 0) + int(winfo.mem_consumed)
                if owner == OUTSIDE_BEFORE and not self._blocks_done:
                    self._stem.add(winfo)

    def close_forward(self) -> None:
        """At the end of the forward: what each part keeps; backward bookkeeping starts from it."""
        alive: dict[str, int] = {}
        for winfo, owner in list(self._owner.items()):
            alive[owner] = alive.get(owner, 0) + int(winfo.mem_consumed)
        self.saved_alive = alive
        self.stem_alive = sum(int(w.mem_consumed) for w in self._stem if w in self._owner)
        for name, winfos in self._outputs.items():
            # the output's storages still tracked at the forward's end (kept by their consumer)
            live = [w for w in (ref() for ref in winfos) if w is not None and w in self._owner]
            self.output_bytes[name] = sum(int(w.mem_consumed) for w in live)
        for name in self._saved:
            self._saved[name] = alive.get(name, 0)
        self.kept = self._start + sum(self._saved.values())

    def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
        super()._post_bw_hook(module, args)
        name = self._blocks.get(id(module)) if module is not None else None
        if name is not None and name in self._saved:
            self.kept += self._grads[name] - self._saved.pop(name)

    def _update_peak_stats(self, peak_state: Any) -> None:
        # The same updates as MemTracker._update_peak_stats, but only for the modules
        # that are running now (looked up by name) instead of every module ever seen.
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
        if self.timeline is not None:
            self.timeline.append((phase, total))
        if phase in self.phase_peak and total > self.phase_peak[phase]:
            self.phase_peak[phase] = total
            self.phase_snap[phase] = dict(curr.get(self.device, {}))
        if phase in self.outside_peak and not (self._block_fqns & parents):
            key = phase
            if self._blocks and phase == "forward" and self._blocks_done == 0:
                key = "forward_before"
            elif self._blocks and phase == "backward" and self._blocks_done and not self._saved:
                key = "backward_before"  # every block's backward is done: the stem's backward
            self.outside_peak[key] = max(self.outside_peak[key], total - self.kept)


def _storages(value: Any) -> list[Any]:
    tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return [st for t in tensors for st in get_untyped_storages(t)]


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
