"""One training step's memory split into phases and blocks, from PyTorch's MemTracker, and
the :class:`memfit.records.Profile` made of one such step per checkpointing mode.

``measure`` reports one peak; profiling and estimating need to know where in the step
memory is held: how much each block keeps from its forward to its backward, the transient
peak inside each block's forward and backward, the part of the step outside the blocks,
and the optimizer step. :func:`phased_step` runs the same :func:`memfit.step.training_step`
under a :class:`~torch.distributed._tools.mem_tracker.MemTracker` (real or fake tensors)
and reads those numbers from its per-module snapshots; :func:`profile_from_memory` turns one
such step per mode (real tensors for :func:`memfit.profile`, fake ones for
:func:`memfit.estimate`) into per-block numbers.

Trade-off: the per-op bookkeeping costs time, so the tracker here replaces MemTracker's
peak update (which visits every module ever seen, for every op: quadratic in model size)
with one that visits only the modules running now; the numbers are the same.

Example:
    >>> import torch
    >>> from memfit.precision import Precision
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> x = torch.randint(0, 256, (2, 16))
    >>> mem = phased_step(model, (x, x), gpt_loss, None, Precision("fp32"), ["blocks.0", "blocks.1"])
    >>> mem.peak == max(mem.phase_peaks.values())
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.checkpointing.compile import eager
from memfit.devices import model_device
from memfit.measuring.tracker import (
    OUTSIDE_AFTER,
    OUTSIDE_BEFORE,
    BlockMemory,
    PhaseTracker,
    block_memory,
    breakdown_of,
)
from memfit.precision import Precision
from memfit.records import BlockStats, Profile
from memfit.step import Batch, LossFn, training_step
from memfit.vocab import CheckpointMode

__all__ = [
    "StepMemory",
    "grad_bytes_of",
    "optimizer_state_bytes",
    "param_bytes",
    "phased_step",
    "profile_from_memory",
]

PHASES = ("forward", "backward", "optimizer")


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
    saved: dict[str, int] = field(default_factory=dict)
    """Per block: bytes it created in its forward that are still alive when the forward ends."""
    outside_before_kept: int = 0
    """Bytes alive when the forward ends that were not created by a block nor by the outside
    after the last block (embedding outputs, the input batch)."""
    stem_kept: int = 0
    """Of it, what the stem made before the first block started (the rest: code between blocks)."""
    outside_forward_before_peak: int = 0
    """Highest (total - start) in the forward before the first block (stem, embeddings)."""
    outside_backward_before_peak: int = 0
    """Highest (total - start - blocks' gradients) after every block's backward (stem's backward)."""
    ops: dict[str, int] = field(default_factory=dict)
    """Per block (and outside key): aten ops its forward dispatched."""
    allocated: dict[str, int] = field(default_factory=dict)
    """Per block (and outside key): bytes of the storages its forward created."""
    output_bytes: dict[str, int] = field(default_factory=dict)
    """Per block: bytes of its output still alive when the forward ends."""
    forward_flops: dict[str, dict[Any, int]] = field(default_factory=dict)
    """FlopCounterMode's counts when the forward ended (empty until the caller counts them)."""
    total_flops: dict[str, dict[Any, int]] = field(default_factory=dict)
    """FlopCounterMode's counts when the step ended (empty until the caller counts them)."""


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
    tracker = PhaseTracker(
        model_device(model),
        {id(model.get_submodule(b)): b for b in blocks},
        {b: grad_bytes_of(model.get_submodule(b)) for b in blocks},
    )
    tracker.track_external(*([model] + ([optimizer] if optimizer is not None else [])))
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    marks = _tracked_step(tracker, model, batch, loss_fn, optimizer if step_optimizer else None, precision)
    return _step_memory(tracker, model, blocks, marks)


@dataclass(frozen=True)
class _Marks:
    """Tracker totals at the step's start and at the forward's and the backward's ends."""

    start: int
    start_parts: dict[str, int]
    forward_end: int
    backward_end: int


def _tracked_step(
    tracker: PhaseTracker,
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision,
) -> _Marks:
    """Run the step under ``tracker``, entering each phase as the step reaches it."""
    marks: dict[str, int] = {}

    def _after_forward() -> None:
        marks["forward_end"] = tracker.total()
        tracker.close_forward()
        tracker.enter_phase("backward")

    def _after_backward() -> None:
        marks["backward_end"] = tracker.total()
        tracker.enter_phase("optimizer")

    # See Note [compiled code runs eagerly when tracked] (memfit.measuring.tracker)
    with eager(), tracker:
        start, start_parts = tracker.total(), tracker.current_parts()
        tracker.enter_phase("forward")
        training_step(
            model,
            batch,
            loss_fn,
            optimizer,
            precision,
            after_forward=_after_forward,
            after_backward=_after_backward,
        )
    return _Marks(start, start_parts, marks.get("forward_end", start), marks.get("backward_end", start))


def _step_memory(
    tracker: PhaseTracker,
    model: nn.Module,
    blocks: list[str],
    marks: _Marks,
) -> StepMemory:
    """What the tracker read during the step, as a :class:`StepMemory`."""
    block_mem = [block_memory(tracker, b, model.get_submodule(b)) for b in blocks]
    peak_phase = max(tracker.phase_peak, key=lambda p: tracker.phase_peak[p])
    saved = {b: tracker.saved_alive.get(b, 0) for b in blocks}
    return StepMemory(
        start=marks.start,
        start_parts=marks.start_parts,
        forward_end=marks.forward_end,
        backward_end=marks.backward_end,
        peak=tracker.phase_peak[peak_phase],
        breakdown=breakdown_of(tracker.phase_snap[peak_phase]),
        phase_peaks=dict(tracker.phase_peak),
        phase_breakdowns={p: breakdown_of(s) for p, s in tracker.phase_snap.items()},
        blocks=block_mem,
        outside_forward_peak=max(0, tracker.outside_peak["forward"]),
        outside_backward_peak=max(0, tracker.outside_peak["backward"]),
        outside_forward_before_peak=max(0, tracker.outside_peak["forward_before"]),
        outside_backward_before_peak=max(0, tracker.outside_peak["backward_before"]),
        ops=dict(tracker.ops),
        allocated=dict(tracker.allocated),
        output_bytes=dict(tracker.output_bytes),
        early_grads=block_mem[-1].backward_grads if block_mem else 0,
        saved=saved,
        outside_before_kept=marks.forward_end
        - marks.start
        - sum(saved.values())
        - tracker.saved_alive.get(OUTSIDE_AFTER, 0),
        stem_kept=tracker.stem_alive,
    )


def param_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


# Note [stem tensors a checkpoint holds]
# A checkpointed block keeps its inputs until its backward: the stem's output it takes (the
# embeddings) and the tensors passed to every block (position ids, a mask). Without
# checkpointing, autograd keeps of them only what a backward reads: nothing, where the
# embeddings are frozen (LoRA) and the ids and mask need no gradient. So the stem's
# tensors alive at the forward's end differ by mode (an HF Llama with LoRA at 2,661 tokens:
# 340,608 B plain, 1,043,112 B fully checkpointed: the embeddings' output and the ids).
# The profile keeps the plain step's (``outside_before_kept_bytes``) and counts the rest
# as saved by the first block in that mode (``BlockStats.stem_saved_bytes``, taken from the
# outside's saved bytes), so it is held while that block's checkpoint is, from its forward
# to its backward; the head's backward, measured above everything the stem kept, is lowered
# by as much (else counted twice). Exact for plans that checkpoint the first block; a plan
# that runs it plain and checkpoints a later one is under by the ids and mask (not the
# embeddings' output): bytes per token, unless the model builds a tokens x tokens mask, and
# the planner's measurement of its plan names such a gap. Only what the stem made before the
# first block counts so: outside code between blocks (DenseNet's transitions) is held by the
# checkpoints of the blocks after it, not the first one's, and stays as it was measured.


def _held_by_checkpoints(base: StepMemory, mem: StepMemory) -> int:
    """The stem's bytes alive at the forward's end in ``mem``'s mode beyond the plain step's
    (See Note [stem tensors a checkpoint holds])."""
    if mem is base:
        return 0
    return max(0, min(mem.outside_before_kept - base.outside_before_kept, mem.stem_kept - base.stem_kept))


def profile_from_memory(
    model: nn.Module,
    blocks: list[str],
    memory: Mapping[CheckpointMode, StepMemory],
    precision: str,
    batch_size: int,
    stand_in: Mapping[str, str] | None = None,
) -> Profile:
    """Turn one :class:`StepMemory` per mode into a :class:`Profile` (memory fields only).

    A step may have run some blocks only (the others passed through); ``stand_in`` maps
    each block that did not run to the one whose numbers it takes. Shared by
    :func:`memfit.profile` (real tensors) and :func:`memfit.estimate` (fake tensors).
    """
    stand_in = dict(stand_in or {})
    modes = list(memory)
    base = memory["none"] if "none" in memory else memory[modes[0]]
    stats = {
        n: BlockStats(
            n, param_bytes(model.get_submodule(n)), grad_bytes=grad_bytes_of(model.get_submodule(n))
        )
        for n in blocks
    }
    for mode in modes:
        mem = memory[mode]
        ran = [b.name for b in mem.blocks]
        for i, b in enumerate(mem.blocks):
            kept = mem.start + mem.outside_before_kept + sum(mem.saved[n] for n in ran[: i + 1])
            for name in [b.name] + [s for s, rep in stand_in.items() if rep == b.name and s not in ran]:
                st = stats[name]
                st.saved_bytes[mode] = mem.saved[b.name]
                st.held_bytes[mode] = b.forward_end - b.forward_start
                st.forward_peak_bytes[mode] = b.forward_peak - b.forward_start
                st.backward_peak_bytes[mode] = b.backward_peak - b.backward_grads - kept
                if mode == "full" or (mode == modes[0] and not st.output_bytes):
                    st.output_bytes = mem.output_bytes.get(b.name, 0)
                if mem is base:
                    st.forward_bytes = mem.allocated.get(b.name, 0)
                    st.forward_ops = mem.ops.get(b.name, 0)
    block_stats = [stats[n] for n in blocks]
    outside = BlockStats(
        name="outside",
        param_bytes=base.start_parts["params"] - sum(s.param_bytes for s in block_stats),
        grad_bytes=_grads_total(base) - sum(s.grad_bytes for s in block_stats),
        forward_bytes=sum(base.allocated.get(k, 0) for k in (OUTSIDE_BEFORE, OUTSIDE_AFTER)),
        forward_ops=sum(base.ops.get(k, 0) for k in (OUTSIDE_BEFORE, OUTSIDE_AFTER)),
    )
    for mode in modes:
        mem = memory[mode]
        outside.saved_bytes[mode] = mem.forward_end - mem.start - sum(mem.saved.values())
        outside.forward_peak_bytes[mode] = mem.outside_forward_peak
        held = _held_by_checkpoints(base, mem)
        outside.backward_peak_bytes[mode] = mem.outside_backward_peak - held
        if held and blocks:  # the outside's and the blocks' still add up to the forward's end
            outside.saved_bytes[mode] -= held
            stats[blocks[0]].saved_bytes[mode] += held
            stats[blocks[0]].stem_saved_bytes[mode] = held
    return Profile(
        precision=precision,
        device=str(model_device(model)),
        batch_size=batch_size,
        blocks=block_stats,
        outside=outside,
        param_bytes=base.start_parts["params"],
        grad_bytes=_grads_total(base),
        optimizer_bytes=base.start_parts["optimizer"],
        optimizer_temp_bytes=max(0, base.phase_peaks.get("optimizer", 0) - base.backward_end),
        outside_before_bytes=base.blocks[0].forward_start - base.start if base.blocks else 0,
        outside_before_kept_bytes=base.outside_before_kept,
        early_grad_bytes=base.early_grads,
        activation_bytes=base.forward_end - base.start,
        outside_before_forward_peak_bytes=base.outside_forward_before_peak,
        outside_before_backward_peak_bytes=base.outside_backward_before_peak,
    )


def _grads_total(mem: StepMemory) -> int:
    return int(mem.phase_breakdowns.get("optimizer", {}).get("grads", 0))
