"""Assemble a :class:`memfit.Profile` from one tracked step per checkpointing mode.

:func:`memfit.measuring.phases.phased_step` reads where one step held memory; this turns
one such step per mode (real tensors for :func:`memfit.profile`, fake ones for
:func:`memfit.estimate`) into per-block numbers, filling the blocks that did not run (an
identical block stood in for them) from the block that did.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from memfit.measuring.phases import StepMemory, grad_bytes_of
from memfit.measuring.tracker import OUTSIDE_AFTER, OUTSIDE_BEFORE, device_of
from memfit.records import BlockStats, Profile

__all__ = ["param_bytes", "profile_from_memory"]


def param_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def profile_from_memory(
    model: nn.Module,
    blocks: list[str],
    memory: Mapping[str, StepMemory],
    precision: str,
    batch_size: int,
    stand_in: Mapping[str, str] | None = None,
) -> Profile:
    """Turn one :class:`StepMemory` per mode into a :class:`Profile` (memory fields only).

    A step may have run some blocks only (the others passed through); ``stand_in`` maps
    each block that did not run to the one whose numbers it takes. Shared by
    :func:`profile` (real tensors) and :func:`memfit.estimate` (fake tensors).
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
        outside.backward_peak_bytes[mode] = mem.outside_backward_peak
    return Profile(
        precision=precision,
        device=str(device_of(model)),
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
