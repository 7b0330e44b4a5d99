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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _ModState

from memfit.measure.memory import _device_of, _parts
from memfit.precision import Precision
from memfit.step import Batch, LossFn, training_step

__all__ = ["BlockMemory", "StepMemory", "grad_bytes_of", "phased_step"]

PHASES = ("forward", "backward", "optimizer")


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
    """Highest (total - start - bytes kept by blocks not yet backwarded - their grads) outside blocks."""
    early_grads: int = 0
    """Gradient bytes that exist when the first block's backward (the last block) starts."""


def grad_bytes_of(module: nn.Module) -> int:
    """Bytes of the gradients of ``module``'s trainable parameters (same dtype as the parameters)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


class _PhaseTracker(MemTracker):
    """MemTracker with phase peaks, outside-of-block peaks and a faster peak update."""

    def __init__(self, device: torch.device, blocks: dict[int, str], grads: dict[str, int]) -> None:
        super().__init__()
        self.device = device
        self.phase = "idle"
        self.phase_peak: dict[str, int] = {}
        self.phase_snap: dict[str, dict[Any, int]] = {}
        self.kept = 0
        self.outside_peak: dict[str, int] = {"forward": 0, "backward": 0}
        self._blocks = blocks  # id(module) -> block name
        self._grads = grads  # block name -> grad bytes
        self._block_fqns: set[str] = set()
        self._saved: dict[str, int] = {}
        self._stats: dict[str, Any] = {}

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
            self.kept = self.total()

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        super()._pre_fw_hook(module, inputs)
        stats = self.memory_tracking[module]
        self._stats[stats.mod_fqn] = stats
        if id(module) in self._blocks:
            self._block_fqns.add(stats.mod_fqn)

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

    def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
        super()._post_bw_hook(module, args)
        name = self._blocks.get(id(module)) if module is not None else None
        if name is not None and name in self._saved:
            self.kept += self._grads[name] - self._saved.pop(name)

    def _update_peak_stats(self, peak_state: Any) -> None:
        # NOTE: same updates as MemTracker._update_peak_stats, but only for the modules
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
                    stats.snapshots[peak_state][-1][dev] = copy.deepcopy(dev_snap)
        for dev, dev_snap in curr.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = copy.deepcopy(dev_snap)
        total = self.total()
        phase = self.phase
        if phase in self.phase_peak and total > self.phase_peak[phase]:
            self.phase_peak[phase] = total
            self.phase_snap[phase] = copy.deepcopy(curr.get(self.device, {}))
        if phase in self.outside_peak and not (self._block_fqns & parents):
            self.outside_peak[phase] = max(self.outside_peak[phase], total - self.kept)


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
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    marks: dict[str, int] = {}

    def _after_forward() -> None:
        marks["forward_end"] = tracker.total()
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
        early_grads=block_mem[-1].backward_grads if block_mem else 0,
    )
