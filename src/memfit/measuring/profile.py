"""Per-block profile of one training step: memory, time and FLOPs under each checkpointing mode.

The planner needs to know, for every block, what checkpointing it saves and what it costs.
:func:`profile` runs one tracked step per mode (every block in that mode), reads the
per-block memory from MemTracker (:mod:`memfit.measuring.phases`), times the whole forward and
backward in each mode (interleaved medians) and splits the time over the blocks by their
share of the forward FLOPs, which it counts with ``FlopCounterMode``.

Trade-off: profiling runs about ``3 * (2 + repeats)`` steps plus a :func:`memfit.measure`,
so it costs seconds on small models; the result is a plain record that can be saved and
planned over without running the model again.

Example:
    >>> import torch
    >>> from memfit.train.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> x = torch.randint(0, 256, (2, 16))
    >>> prof = profile(model, (x, x), gpt_loss, repeats=1)
    >>> [b.name for b in prof.blocks]
    ['blocks.0', 'blocks.1']
    >>> prof.blocks[0].saved_bytes["full"] < prof.blocks[0].saved_bytes["none"]
    True
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections import defaultdict

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from memfit.checkpointing import checkpointed_blocks, find_blocks, set_block_modes, uncheckpoint
from memfit.measuring.batchcheck import checked_step, tensor_bytes
from memfit.measuring.memory import measure
from memfit.measuring.phases import StepMemory, grad_bytes_of, optimizer_state_bytes, phased_step
from memfit.measuring.preserve import preserved
from memfit.measuring.tracker import device_of
from memfit.precision import Precision, as_precision
from memfit.recompute import copies_made
from memfit.records import BlockStats, Profile
from memfit.step import Batch, LossFn, batch_size, training_step
from memfit.vocab import CHECKPOINT_MODES

__all__ = ["inplace_notes", "inplace_parts", "profile", "profile_from_memory"]


def _param_bytes(module: nn.Module) -> int:
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mode_times(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    precision: Precision,
    blocks: list[str],
    modes: tuple[str, ...],
    repeats: int,
) -> dict[str, tuple[float, float]]:
    """Median (forward, backward) seconds of the whole model with every block in each mode.

    Modes run interleaved (none, selective, full, none, ...) after one warm-up round, so
    drift of a shared machine hits them alike.
    """
    device = device_of(model)
    fw: dict[str, list[float]] = defaultdict(list)
    bw: dict[str, list[float]] = defaultdict(list)
    marks: dict[str, float] = {}

    def _mark(name: str) -> None:
        _sync(device)
        marks[name] = time.perf_counter()

    for round_ in range(repeats + 1):
        for mode in modes:
            if blocks:
                set_block_modes(model, {b: mode for b in blocks})
            _mark("start")
            training_step(
                model,
                batch,
                loss_fn,
                None,
                precision,
                after_forward=lambda: _mark("forward"),
                after_backward=lambda: _mark("backward"),
            )
            if round_:
                fw[mode].append(marks["forward"] - marks["start"])
                bw[mode].append(marks["backward"] - marks["forward"])
    return {m: (statistics.median(fw[m]), statistics.median(bw[m])) for m in modes}


def _shares(prof: Profile, fw_flops: dict[str, int], root: str) -> tuple[list[float], float]:
    """Each block's and the outside part's share of the forward work.

    FLOPs where FlopCounterMode counts any (matmuls, convolutions); parameter bytes where it
    counts none (e.g. a model of elementwise ops only).
    """
    weights = [float(fw_flops.get(f"{root}.{b.name}", 0)) for b in prof.blocks]
    outside = float(max(0, fw_flops.get("Global", 0) - sum(weights)))
    if sum(weights) + outside <= 0:
        weights = [float(b.param_bytes) for b in prof.blocks]
        outside = float(prof.outside.param_bytes)
    total = sum(weights) + outside or 1.0
    return [w / total for w in weights], outside / total


def _flops(
    model: nn.Module, batch: Batch, loss_fn: LossFn, precision: Precision, grad: bool
) -> dict[str, int]:
    """FLOPs per module name (ModuleTracker names: ``<RootClass>.<qualified name>``)."""
    counter = FlopCounterMode(display=False)
    with counter:
        if grad:
            training_step(model, batch, loss_fn, None, precision)
        else:
            with torch.no_grad(), precision.autocast():
                loss_fn(model, batch)
    return {k: int(sum(v.values())) for k, v in counter.get_flop_counts().items()}


def profile_from_memory(
    model: nn.Module,
    blocks: list[str],
    memory: dict[str, StepMemory],
    precision: str,
    batch_size: int,
) -> Profile:
    """Turn one :class:`StepMemory` per mode into a :class:`Profile` (memory fields only).

    Shared by :func:`profile` (real tensors) and :func:`memfit.estimate` (fake tensors).
    """
    modes = list(memory)
    base = memory["none"] if "none" in memory else memory[modes[0]]
    stats: list[BlockStats] = []
    for i, name in enumerate(blocks):
        module = model.get_submodule(name)
        st = BlockStats(name=name, param_bytes=_param_bytes(module), grad_bytes=grad_bytes_of(module))
        for mode in modes:
            mem = memory[mode]
            b = mem.blocks[i]
            kept = mem.start + mem.outside_before_kept + sum(mem.saved[n] for n in blocks[: i + 1])
            st.saved_bytes[mode] = mem.saved[name]
            st.held_bytes[mode] = b.forward_end - b.forward_start
            st.forward_peak_bytes[mode] = b.forward_peak - b.forward_start
            st.backward_peak_bytes[mode] = b.backward_peak - b.backward_grads - kept
        stats.append(st)
    block_params = sum(s.param_bytes for s in stats)
    outside = BlockStats(
        name="outside",
        param_bytes=base.start_parts["params"] - block_params,
        grad_bytes=_grads_total(base) - sum(s.grad_bytes for s in stats),
    )
    for mode in modes:
        mem = memory[mode]
        outside.saved_bytes[mode] = mem.forward_end - mem.start - sum(s.saved_bytes[mode] for s in stats)
        outside.forward_peak_bytes[mode] = mem.outside_forward_peak
        outside.backward_peak_bytes[mode] = mem.outside_backward_peak
    first = base.blocks[0].forward_start - base.start if blocks else 0
    return Profile(
        precision=precision,
        device=str(device_of(model)),
        batch_size=batch_size,
        blocks=stats,
        outside=outside,
        param_bytes=base.start_parts["params"],
        grad_bytes=_grads_total(base),
        optimizer_bytes=base.start_parts["optimizer"],
        optimizer_temp_bytes=max(0, base.phase_peaks.get("optimizer", 0) - base.backward_end),
        outside_before_bytes=first,
        outside_before_kept_bytes=base.outside_before_kept,
        early_grad_bytes=base.early_grads,
        outside_before_backward_bytes=max(
            max(0, memory[m].outside_after_blocks_peak - memory[m].early_grads) for m in modes
        ),
        activation_bytes=base.forward_end - base.start,
    )


def _grads_total(mem: StepMemory) -> int:
    return int(mem.phase_breakdowns.get("optimizer", {}).get("grads", 0))


def profile(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None = None,
    precision: str | Precision = "fp32",
    repeats: int = 3,
) -> Profile:
    """Profile each block's memory, time and FLOPs under none, selective and full checkpointing.

    Every number for mode ``m`` comes from a step with every block in mode ``m``; the
    model's own checkpointing, weights, gradients, optimizer state and RNG are restored
    afterwards. A model without repeated blocks is profiled as one part (``outside``),
    with a warning.

    Args:
        model: the model, on its device.
        batch: a tensor or tuple of tensors whose first dimension is the batch.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        optimizer: its state and step are part of the step (None: forward and backward only).
        precision: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"auto"`` or a Precision.
        repeats: timed steps per mode; medians are reported.

    Returns:
        A :class:`memfit.Profile` (see its docstring for what each number means).

    Raises:
        ConfigError: the batch does not fit the model (one step on it fails).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    device = device_of(model)
    prec = as_precision(precision, device=device)
    blocks = find_blocks(model)
    notes: list[str] = []
    if not blocks:
        msg = (
            f"{type(model).__name__} has no repeated blocks (find_blocks found none); it is "
            "profiled as one part, 'outside', and checkpointing cannot be planned for it."
        )
        warnings.warn(msg, stacklevel=2)
        notes.append(msg)
    original = checkpointed_blocks(model)
    scaler_state = prec.scaler.state_dict()
    memory: dict[str, StepMemory] = {}
    copied: dict[str, dict[str, set[str]]] = {}
    totals: dict[str, dict[str, int]] = {}
    modes = CHECKPOINT_MODES if blocks else ("none",)
    try:
        with preserved(model, optimizer):
            model.train()
            uncheckpoint(model)
            checked_step(model, batch, loss_fn, optimizer, prec)
            by_dtype = optimizer_state_bytes(optimizer)
            fw_flops = _flops(model, batch, loss_fn, prec, grad=False)
            for mode in modes:
                if blocks:
                    set_block_modes(model, {b: mode for b in blocks})
                for b in blocks:
                    copies_made(model.get_submodule(b), clear=True)
                memory[mode] = phased_step(model, batch, loss_fn, optimizer, prec, blocks)
                copied[mode] = {b: copies_made(model.get_submodule(b)) for b in blocks}
                totals[mode] = _flops(model, batch, loss_fn, prec, grad=True)
            times = _mode_times(model, batch, loss_fn, prec, blocks, modes, repeats)
            uncheckpoint(model)
            base = measure(model, batch, loss_fn, optimizer, prec, steps=repeats)
    finally:
        uncheckpoint(model)
        if original:
            set_block_modes(model, original)
        if scaler_state:
            prec.scaler.load_state_dict(scaler_state)
    prof = profile_from_memory(model, blocks, memory, prec.mode, batch_size(batch))
    root = type(model).__name__
    # NOTE: per-block hooks time a block badly on a CPU (hook and dispatch overhead is as large
    # as a small block, and recompute runs inside another block's backward). The whole step
    # is timed instead, per mode, and split over the blocks by their share of the forward
    # FLOPs: a block's cost in mode m is its share of (forward + backward with all blocks in
    # m), less the outside part's share, which does not depend on the blocks' mode.
    shares, out_share = _shares(prof, fw_flops, root)
    fw_none, bw_none = times["none"]
    out = prof.outside
    out.forward_seconds = fw_none * out_share
    block_share = (1.0 - out_share) or 1.0
    fw_blocks = 0
    for st, share in zip(prof.blocks, shares, strict=True):
        key = f"{root}.{st.name}"
        st.forward_flops = fw_flops.get(key, 0)
        fw_blocks += st.forward_flops
        st.forward_seconds = fw_none * share
        for mode in modes:
            st.backward_flops[mode] = totals[mode].get(key, 0) - st.forward_flops
            fw_m, bw_m = times[mode]
            blocks_time = fw_m + bw_m - fw_none * out_share - bw_none * out_share
            st.backward_seconds[mode] = max(0.0, blocks_time * share / block_share - st.forward_seconds)
    out.forward_flops = fw_flops.get("Global", 0) - fw_blocks
    for mode in modes:
        blocks_total = sum(totals[mode].get(f"{root}.{st.name}", 0) for st in prof.blocks)
        out.backward_flops[mode] = totals[mode].get("Global", 0) - blocks_total - out.forward_flops
        out.backward_seconds[mode] = bw_none * out_share
    prof.optimizer = type(optimizer).__name__ if optimizer is not None else "none"
    prof.optimizer_bytes_by_dtype = by_dtype
    prof.input_bytes = tensor_bytes(batch)
    prof.measured_peak_bytes = base.peak_bytes
    prof.step_seconds = base.step_seconds
    prof.notes = notes + inplace_notes(copied) + _flop_notes(device)
    return prof


_INPLACE = ": an in-place op"


def inplace_notes(copied: dict[str, dict[str, set[str]]]) -> list[str]:
    """One note per kind of in-place write the checkpointed blocks made, naming the blocks.

    Each note reads ``"<block>, <block>: an in-place op ...; under <mode> or <mode>
    checkpointing memfit copies ..."``; :func:`inplace_parts` reads the names back.

    Example:
        >>> inplace_notes({"full": {"b0": {"its input"}, "b1": set()}})[0][:50]
        'b0: an in-place op in the forward writes into its '
    """
    by_kind: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for mode in copied:
        kinds: dict[str, list[str]] = {}
        for name, whats in copied[mode].items():
            for what in whats:
                kinds.setdefault(what, []).append(name)
        for what, names in kinds.items():
            by_kind.setdefault((what, tuple(names)), []).append(mode)
    return [
        f"{', '.join(names)}{_INPLACE} in the forward writes into {what}; under {' or '.join(modes)} "
        "checkpointing memfit copies it just before the write, so the recompute is exact (the copy is "
        "counted in the profile)."
        for (what, names), modes in sorted(by_kind.items())
    ]


def inplace_parts(note: str) -> tuple[list[str], list[str]]:
    """The blocks and modes an :func:`inplace_notes` note names (empty for any other note)."""
    head, sep, rest = note.partition(_INPLACE)
    if not sep:
        return [], []
    modes = rest.partition("; under ")[2].partition(" checkpointing")[0]
    return head.split(", "), modes.split(" or ")


def _flop_notes(device: torch.device) -> list[str]:
    if device.type == "cpu":
        return ["FlopCounterMode has no formula for the CPU attention kernel; its FLOPs count as 0."]
    return []
