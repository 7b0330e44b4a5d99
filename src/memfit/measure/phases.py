"""One training step's memory split into phases and blocks, from PyTorch's MemTracker.

``measure`` reports one peak; profiling and estimating need to know where in the step
memory is held: how much each block keeps from its forward to its backward, the transient
peak inside each block's forward and backward, the part of the step outside the blocks,
and the optimizer step. :func:`phased_step` runs the same :func:`memfit.step.training_step`
under a :class:`~torch.distributed._tools.mem_tracker.MemTracker` (real or fake tensors)
and reads those numbers from its per-module snapshots.

Trade-off: the per-op bookkeeping costs time, so the tracker here replaces MemTracker's
peak update (which visits every module ever seen, for every op: quadratic in model size)
with one that visits only the modules running now; the numbers are the same.

Example:
    >>> import torch
    >>> from memfit.precision import Precision
    >>> from memfit.train.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> x = torch.randint(0, 256, (2, 16))
    >>> mem = phased_step(model, (x, x), gpt_loss, None, Precision("fp32"), ["blocks.0", "blocks.1"])
    >>> mem.peak == max(mem.phase_peaks.values())
    True
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, _MemRefType, _ModState

from memfit.measure.memory import FastMemTracker, _device_of, _parts, ignore_frozen_parameters
from memfit.precision import Precision
from memfit.step import Batch, LossFn, training_step

__all__ = ["BlockMemory", "StepMemory", "grad_bytes_of", "optimizer_state_bytes", "phased_step"]

PHASES = ("forward", "backward", "optimizer")
_BEFORE, _AFTER = "<outside before>", "<outside after>"


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


@dataclass
class StepMemory:
    """Where one training step holds memory; every number is a MemTracker total in bytes."""

    start: int
    """Total when the step starts (gradients already freed): parameters, buffers, optimizer state."""
    start_parts: dict[str, int]
    """``start`` split into memfit's breakdown keys."""
    forward_end: int
    """Total when the loss is ready."""
    backward_end: int
    """Total after the last backward, before the optimizer step."""
    peak: int
    """Highest total of the step."""
    breakdown: dict[str, int]
    """The peak split into memfit's breakdown keys."""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    """Highest total in each phase (forward, backward, optimizer)."""
    phase_breakdowns: dict[str, dict[str, int]] = field(default_factory=dict)
    """Each phase's peak split into memfit's breakdown keys."""
    blocks: list[BlockMemory] = field(default_factory=list)
    """Per block, in forward order."""
    outside_forward_peak: int = 0
    """Highest (total - start - bytes kept by blocks whose forward finished) outside blocks in forward."""
    outside_backward_peak: int = 0
    """Highest (total - start - bytes kept by blocks not yet backwarded - their grads) outside
    blocks in backward, before every block's backward is done (loss, head)."""
    outside_after_blocks_peak: int = 0
    """Highest (total - start - every block's grads) once every block's backward is done: the
    backward of the part before the blocks (stem, embeddings)."""
    early_grads: int = 0
    """Gradient bytes that exist when the first block's backward (the last block) starts."""
    saved: dict[str, int] = field(default_factory=dict)
    """Per block: bytes it created in its forward that are still alive when the forward ends."""
    outside_before_kept: int = 0
    """Bytes alive when the forward ends that were not created by a block nor by the outside
    after the last block (embedding outputs, the input batch)."""


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of the optimizer's state tensors by dtype name (``{"float32": ...}``)."""
    out: dict[str, int] = {}
    if optimizer is None:
        return out
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                key = str(value.dtype).removeprefix("torch.")
                out[key] = out.get(key, 0) + value.numel() * value.element_size()
    return out


def grad_bytes_of(module: nn.Module) -> int:
    """Bytes of the gradients of ``module``'s trainable parameters (same dtype as the parameters)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


class _PhaseTracker(FastMemTracker):
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
        self._fqn_names: dict[str, str] = {}
        self._owner: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._blocks_done = 0
        self._before: weakref.WeakSet[Any] = weakref.WeakSet()
        self.saved_alive: dict[str, int] = {}

    def total(self) -> int:
        return int(self._curr_mem_snap.get(self.device, {}).get(_TOTAL_KEY, 0))

    def current_parts(self) -> dict[str, int]:
        return _parts(self._curr_mem_snap.get(self.device, {}))

    def grads_now(self) -> int:
        return int(self._curr_mem_snap.get(self.device, {}).get(_MemRefType.GRAD, 0))

    def enter_phase(self, phase: str) -> None:
        self.phase = phase
        self.phase_peak[phase] = self.total()
        self.phase_snap[phase] = copy.deepcopy(self._curr_mem_snap.get(self.device, {}))
        if phase == "forward":
            self.kept = self._start = self.total()
            # parameters, buffers, optimizer state: never owned by a part of the forward
            self._before = weakref.WeakSet(winfo for winfo, _ in self._WINFO.values())

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        super()._pre_fw_hook(module, inputs)
        stats = self.memory_tracking[module]
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
            owner = _AFTER if self._blocks and self._blocks_done >= len(self._blocks) else _BEFORE
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
        super()._update_peak_stats(peak_state)
        curr = self._curr_mem_snap
        parents = self._mod_tracker.parents
        total = self.total()
        phase = self.phase
        if phase in self.phase_peak and total > self.phase_peak[phase]:
            self.phase_peak[phase] = total
            self.phase_snap[phase] = dict(curr.get(self.device, {}))
        if phase in self.outside_peak and not (self._block_fqns & parents):
            # NOTE: once every block's backward is done, what runs is the backward of the part
            # before the blocks (stem, embeddings), with every block's gradient held: its own event.
            after = phase == "backward" and self._blocks_done > 0 and not self._saved
            bucket = "after blocks" if after else phase
            self.outside_peak[bucket] = max(self.outside_peak[bucket], total - self.kept)


def _tot(snapshot: dict[Any, dict[Any, int]], device: torch.device) -> int:
    return int(snapshot.get(device, {}).get(_TOTAL_KEY, 0))


def _block_memory(tracker: _PhaseTracker, name: str, module: nn.Module) -> BlockMemory:
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


def phased_step(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision,
    blocks: list[str],
    step_optimizer: bool = True,
) -> StepMemory:
    """Run one training step under MemTracker and return where it held memory.

    Args:
        model: the model (real or fake tensors), checkpointed as it should be measured.
        batch: the batch; loss_fn: ``loss_fn(model, batch) -> scalar``.
        optimizer: its state counts as held memory; its step is the third phase.
        precision: the precision the step runs in.
        blocks: qualified names of the blocks to report on, in forward order.
        step_optimizer: False skips the optimizer step (its state is still counted), for
            callers that already know the optimizer phase from an identical step.

    Returns:
        A :class:`StepMemory`.
    """
    device = _device_of(model)
    modules = {id(model.get_submodule(b)): b for b in blocks}
    grads = {b: grad_bytes_of(model.get_submodule(b)) for b in blocks}
    tracker = _PhaseTracker(device, modules, grads)
    tracker.track_external(*([model] + ([optimizer] if optimizer is not None else [])))
    ignore_frozen_parameters(tracker, model)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    marks: dict[str, int] = {}

    def _after_forward() -> None:
        marks["forward_end"] = tracker.total()
        tracker.close_forward()
        tracker.enter_phase("backward")

    def _after_backward() -> None:
        marks["backward_end"] = tracker.total()
        tracker.enter_phase("optimizer")

    with tracker:
        start, start_parts = tracker.total(), tracker.current_parts()
        tracker.enter_phase("forward")
        training_step(
            model,
            batch,
            loss_fn,
            optimizer if step_optimizer else None,
            precision,
            after_forward=_after_forward,
            after_backward=_after_backward,
        )
    block_mem = [_block_memory(tracker, b, model.get_submodule(b)) for b in blocks]
    peak_phase = max(tracker.phase_peak, key=lambda p: tracker.phase_peak[p])
    return StepMemory(
        start=start,
        start_parts=start_parts,
        forward_end=marks.get("forward_end", start),
        backward_end=marks.get("backward_end", start),
        peak=tracker.phase_peak[peak_phase],
        breakdown=_parts(tracker.phase_snap[peak_phase]),
        phase_peaks=dict(tracker.phase_peak),
        phase_breakdowns={p: _parts(s) for p, s in tracker.phase_snap.items()},
        blocks=block_mem,
        outside_forward_peak=max(0, tracker.outside_peak["forward"]),
        outside_backward_peak=max(0, tracker.outside_peak["backward"]),
        outside_after_blocks_peak=max(0, tracker.outside_peak["after blocks"]),
        early_grads=block_mem[-1].backward_grads if block_mem else 0,
        saved={b: tracker.saved_alive.get(b, 0) for b in blocks},
        outside_before_kept=marks.get("forward_end", start)
        - start
        - sum(tracker.saved_alive.get(b, 0) for b in blocks)
        - tracker.saved_alive.get(_AFTER, 0),
    )
