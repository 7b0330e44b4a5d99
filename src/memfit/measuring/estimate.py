"""Estimate a training step's memory for every precision x checkpointing mode, allocating nothing.

The model, its optimizer and the batch are built under PyTorch's ``FakeTensorMode``: tensors
carry shapes, dtypes and devices but no storage, so a 7B-parameter model fits in a laptop's
memory. The same :func:`memfit.step.training_step` then runs under the same MemTracker
accounting :func:`memfit.measure` uses (:func:`memfit.measuring.phases.phased_step`), once
per precision and mode, so the estimate is what ``measure`` would report on this device
type, activations included (HF's ``accelerate estimate-memory`` and DeepSpeed's estimators
count parameters, gradients and optimizer state only).

Where fake tensors alone fail but real training works (a constructor that reads the values
it draws, a fake kernel narrower than the real one, a forward that reads the batch's values),
:mod:`memfit.measuring.fakebuild` falls back and the estimate says which in one line.

Trade-off: nothing is computed on parameters or activations, so nothing that depends on
their values is either: fp16's dynamic loss scaling (which reads the gradients) is left out
of the fake step; it holds only a few scalars. The optimizer step is the same for every
strategy (parameters, gradients and state stay fp32), so it runs once and its phase is
reused: exact, and half the time.

Example:
    >>> import torch
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> x = torch.randint(0, 256, (2, 16))
    >>> est = estimate(lambda: GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)),
    ...                (x, x), gpt_loss, lambda p: torch.optim.AdamW(p), device_memory="2MiB")
    >>> est.peak_bytes("fp32", "full") < est.peak_bytes("fp32", "none")
    True
    >>> est.fits[0]
    ('bf16', 'none')
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit import progress
from memfit.budget import parse_bytes
from memfit.checkpointing import find_blocks, set_block_modes
from memfit.devices import model_device
from memfit.errors import ConfigError
from memfit.measuring.batchcheck import batch_errors
from memfit.measuring.fakebuild import FakeFallbacks, build_fake, fake_batch, model_limits
from memfit.measuring.lever_facts import attach_lever_facts, head_facts
from memfit.measuring.long_context import tiled_floor, tiled_mlp_facts
from memfit.measuring.order import run_order
from memfit.measuring.phases import StepMemory, optimizer_state_bytes, phased_step, profile_from_memory
from memfit.measuring.preserve import create_optimizer_state
from memfit.measuring.repeated_blocks import fast_profiles, identical, outputs_keep_shape, stand_ins
from memfit.measuring.twin import Twin, twin_precision
from memfit.precision import Precision, precision_kind
from memfit.records import BREAKDOWN_KEYS, Estimate, EstimateEntry, Profile
from memfit.step import Batch, LossFn, batch_size
from memfit.stepmodel import simulate
from memfit.vocab import (
    CHECKPOINT_MODES,
    PRECISIONS,
    CheckpointMode,
    PrecisionName,
    normalize_mode,
    normalize_precision,
)

__all__ = ["estimate"]


def _fake_precision(precision: PrecisionName, device: torch.device) -> Precision:
    return twin_precision(Precision(precision, device=device))


def _entry(
    precision: PrecisionName, mode: CheckpointMode, mem: StepMemory, opt: StepMemory | None
) -> EstimateEntry:
    peak, parts = mem.peak, dict(mem.breakdown)
    if opt is not None and "optimizer" in opt.phase_peaks:
        # the optimizer phase of this step: its own backward end plus the shared temporaries
        opt_peak = mem.backward_end + opt.phase_peaks["optimizer"] - opt.backward_end
        if opt_peak > peak:
            peak, parts = opt_peak, dict(opt.phase_breakdowns["optimizer"])
            parts["temporaries"] += peak - sum(parts.values())
    return EstimateEntry(
        precision=precision,
        mode=mode,
        peak_bytes=int(peak),
        breakdown={k: int(parts.get(k, 0)) for k in BREAKDOWN_KEYS},
        activation_bytes=int(mem.forward_end - mem.start),
    )


@dataclass
class _Fake:
    """The model, optimizer and batch built under one ``FakeTensorMode``, and what the
    estimate found about them."""

    mode: FakeTensorMode
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    batch: Batch
    """The real batch copied to fake tensors."""
    blocks: list[str]
    device: torch.device
    fallbacks: FakeFallbacks
    """What the fake kernels refused and a real step runs, answered (and counted)."""
    built: str | None = None
    """None when ``model_fn`` ran under fake tensors; else the line saying how it was built."""
    stand_in: dict[str, str] = field(default_factory=dict)
    """Where the blocks are identical and residual, those that passed their input through,
    each to the block whose numbers it takes (:func:`stand_ins`); empty where every block ran."""


def _checked_names(
    precisions: Iterable[str], modes: Iterable[str]
) -> tuple[list[PrecisionName], list[CheckpointMode]]:
    checked = [cast(PrecisionName, normalize_precision(p)) for p in precisions]
    checked_modes = [normalize_mode(m) for m in modes]
    if not checked or not checked_modes:
        raise ConfigError(
            f"cannot estimate nothing; precisions are {', '.join(PRECISIONS)} and "
            f"modes are {', '.join(CHECKPOINT_MODES)}."
        )
    return checked, checked_modes


def _build(
    model_fn: Callable[[], nn.Module],
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None,
    batch: Batch,
) -> _Fake:
    fake = FakeTensorMode(allow_non_fake_inputs=False)
    built = build_fake(fake, model_fn)
    if built.how is not None:
        progress.note(built.how)
    model = built.model
    with fake:
        optimizer = optimizer_fn(model.parameters()) if optimizer_fn is not None else None
    fake_inputs = fake_batch(fake, batch)
    fallbacks = FakeFallbacks(fake, fake_inputs)
    return _Fake(
        fake, model, optimizer, fake_inputs, find_blocks(model), model_device(model), fallbacks, built.how
    )


def _fast(f: _Fake, batch: Batch, loss_fn: LossFn) -> bool:
    """Whether the blocks are identical, keep their input's shape and run in module order
    (checked on ``batch``; CLIP's identical towers run vision first).

    See Note [blocks in the order they ran].
    """
    if len(f.blocks) <= 2 or not identical(f.model, f.blocks):
        return False
    with batch_errors(f.model, batch), model_limits(f.model), run_order(f.model, f.blocks) as seen:
        keeps = outputs_keep_shape(f.model, f.blocks[-1], f.batch, loss_fn)
    return keeps and list(seen) == list(f.blocks)


def _fast_estimate(
    f: _Fake, loss_fn: LossFn, precisions: list[PrecisionName], modes: list[CheckpointMode]
) -> tuple[dict[str, Profile], list[EstimateEntry]]:
    """Profiles from steps that run two of the identical blocks; entries from the step model."""
    with model_limits(f.model):
        profiles = fast_profiles(
            f.model, (f.batch, loss_fn), f.optimizer, f.blocks, f.stand_in, precisions, modes,
            lambda p: _fake_precision(p, f.device),
        )  # fmt: skip
    entries = []
    for precision in precisions:
        prof = profiles[precision]
        for mode in modes:
            sim = simulate(prof, mode)
            acts = prof.outside.saved_bytes[mode] + sum(b.saved_bytes[mode] for b in prof.blocks)
            entries.append(EstimateEntry(precision, mode, sim.peak_bytes, sim.breakdown, acts))
    return profiles, entries


def _derived(precisions: Sequence[str]) -> dict[str, str]:
    """``{precision: the one whose memory it has}`` for those of ``precisions`` not run again
    (See Note [fp16 is bf16's memory])."""
    kinds = {p: precision_kind(p).memory_as for p in precisions}
    return {p: same for p, same in kinds.items() if same and same in precisions}


def _profiles_and_entries(
    f: _Fake,
    batch: Batch,
    loss_fn: LossFn,
    precisions: list[PrecisionName],
    modes: list[CheckpointMode],
) -> tuple[dict[str, Profile], list[EstimateEntry]]:
    """Every entry, in the order of ``precisions``, and one profile per precision."""
    # Note [fp16 is bf16's memory]
    # fp16 and bf16 have the same element size and autocast casts the same ops to either,
    # so their memory is the same (loss scaling aside): fp16 is not run again (its kind's
    # memory_as names bf16).
    derived = _derived(precisions)
    run_precisions = [p for p in precisions if p not in derived]
    entries: list[EstimateEntry] = []
    with f.mode, f.fallbacks:
        f.model.train()
        create_optimizer_state(f.model, f.optimizer)
        f.stand_in = stand_ins(f.model, f.blocks, [True] * len(f.blocks)) if _fast(f, batch, loss_fn) else {}
        if f.stand_in:
            profiles, entries = _fast_estimate(f, loss_fn, run_precisions, modes)
        else:
            profiles = _direct(
                f.model, f.batch, loss_fn, f.optimizer, f.blocks, run_precisions, modes, f.device, entries
            )
        for p, same in derived.items():
            profiles[p] = dataclasses.replace(profiles[same], precision=p)
            entries += [dataclasses.replace(e, precision=p) for e in entries if e.precision == same]
        rank = {p: i for i, p in enumerate(precisions)}
        entries.sort(key=lambda e: rank[cast(PrecisionName, e.precision)])
    return profiles, entries


def _finish_profiles(
    f: _Fake, profiles: dict[str, Profile], levers: bool | Sequence[str], step: tuple[Batch, LossFn]
) -> None:
    """The optimizer's facts (and, with ``levers``, the levers', the loss head's included, and
    the tiled MLP's where ``levers`` names it) on every profile."""
    by_dtype = optimizer_state_bytes(f.optimizer)
    tiled = not isinstance(levers, bool) and "tiled_mlp" in levers
    with progress.phase("what the levers would save, per precision", len(profiles) if levers else 0) as ph:
        for prof in ph.over(profiles.values() if levers else []):
            attach_lever_facts(prof, f.model, f.optimizer, f.blocks)
            assert prof.lever_facts is not None
            with f.mode, f.fallbacks:  # the head alone, on fake tensors too (Note [the head measured alone])
                prof.lever_facts.head = head_facts(f.model, step[0], step[1], prof.precision)
                if tiled:  # one MLP alone at the step's shape, plain and tiled
                    prof.lever_facts.tiled_mlp = tiled_mlp_facts(f.model, step[0], step[1], prof.precision)
            if tiled:  # See Note [a tiled MLP in its block] in memfit/stepmodel/tiled_mlp.py
                twin = Twin(f.mode, f.model, f.optimizer, f.batch, f.fallbacks)
                fake = _fake_precision(cast(PrecisionName, prof.precision), f.device)
                tiled_floor(twin, step[1], fake, prof, f.blocks, f.stand_in)
    for prof in profiles.values():
        prof.optimizer = type(f.optimizer).__name__ if f.optimizer is not None else "none"
        prof.optimizer_bytes_by_dtype = dict(by_dtype)


def estimate(
    model_fn: Callable[[], nn.Module],
    batch: Batch,
    loss_fn: LossFn,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    device_memory: int | str | None = None,
    precisions: Iterable[PrecisionName | str] = PRECISIONS,
    modes: Iterable[CheckpointMode | str] = CHECKPOINT_MODES,
    levers: bool | Sequence[str] = False,
) -> Estimate:
    """Predict the peak bytes of one steady-state training step per precision and mode.

    Args:
        model_fn: builds a fresh model; it is called under ``FakeTensorMode`` (build on
            the CPU, as for a real run; do not load weights), or on the meta device where
            its constructor needs real values (the assumptions say so).
        batch: a small real batch of the right shape (tensor or tuple of tensors); it is
            copied to fake tensors.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        optimizer_fn: ``optimizer_fn(params) -> optimizer``; None estimates forward and
            backward only.
        device_memory: bytes available ("24GiB", "80GB", int); fills ``Estimate.fits``.
        precisions: subset of fp32, bf16, fp16.
        modes: subset of none, selective, full.
        levers: also count what the levers need (:func:`memfit.measuring.lever_facts.attach_lever_facts`:
            parameters per block, and one small real optimizer step per state kind); a list of
            lever names that includes ``tiled_mlp`` also measures one MLP alone, plain and
            tiled, on fake tensors (:func:`memfit.measuring.long_context.tiled_mlp_facts`).

    Returns:
        An :class:`memfit.records.Estimate`.

    Raises:
        ConfigError: bad ``device_memory``, an unknown precision or mode, a model_fn that
            does not return a module or cannot be built without allocating it, a batch that
            does not fit the model, or a step that needs an activation's value (the model's
            limit under fake tensors; the message says so and points to ``memfit.profile``).
    """
    started = time.perf_counter()
    memory = None if device_memory is None else parse_bytes(device_memory, what="device memory")
    checked, checked_modes = _checked_names(precisions, modes)
    with progress.phase("building the model under fake tensors (nothing allocated)"):
        f = _build(model_fn, optimizer_fn, batch)
    profiles, entries = _profiles_and_entries(
        f, batch, loss_fn, checked, checked_modes if f.blocks else ["none"]
    )
    _finish_profiles(f, profiles, levers, (f.batch, loss_fn))
    for line in f.fallbacks.lines():
        progress.note(line)
    derived = bool(_derived(checked))
    return Estimate(
        model=type(f.model).__name__,
        param_count=sum(p.numel() for p in f.model.parameters()),
        batch_size=batch_size(batch),
        device=f"{f.device} (fake tensors)",
        optimizer=type(f.optimizer).__name__ if f.optimizer is not None else "none",
        entries=entries,
        device_memory=memory,
        assumptions=_assumptions(f, derived),
        profiles=profiles,
        seconds=time.perf_counter() - started,
    )


def _direct(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    blocks: list[str],
    precisions: list[PrecisionName],
    modes: list[CheckpointMode],
    device: torch.device,
    entries: list[EstimateEntry],
) -> dict[str, Profile]:
    """One full fake step per precision and mode (blocks that differ, or few blocks)."""
    profiles: dict[str, Profile] = {}
    opt_phase: StepMemory | None = None
    for precision in precisions:
        prec = _fake_precision(precision, device)
        per_mode: dict[CheckpointMode, StepMemory] = {}
        with progress.phase(f"{precision}: fake-tensor steps per checkpointing mode", len(modes)) as ph:
            for mode in modes:
                if blocks:
                    set_block_modes(model, {b: mode for b in blocks})
                first = opt_phase is None
                with batch_errors(model, batch), model_limits(model):
                    mem = phased_step(model, batch, loss_fn, optimizer, prec, blocks, step_optimizer=first)
                opt_phase = mem if first else opt_phase
                per_mode[mode] = mem
                entries.append(_entry(precision, mode, mem, opt_phase))
                ph.advance(detail=mode)
        prof = profile_from_memory(model, blocks, per_mode, precision, batch_size(batch))
        if opt_phase is not None:
            prof.optimizer_temp_bytes = max(
                0, opt_phase.phase_peaks.get("optimizer", 0) - opt_phase.backward_end
            )
        profiles[precision] = prof
    return profiles


def _assumptions(f: _Fake, derived: bool) -> list[str]:
    device, optimizer, blocks = f.device, f.optimizer, f.blocks
    out = [
        f"Counts are PyTorch's MemTracker bytes for the {device.type.upper()} kernels of this "
        "machine (e.g. its attention kernel); a GPU adds allocator rounding, cuBLAS/cuDNN "
        "workspaces and the CUDA context, typically a few hundred MiB.",
        "Parameters and optimizer state are fp32 and every parameter is trained; bf16/fp16 "
        "run under torch.autocast (weights cast per op), gradients are fp32.",
        "fp16 loss scaling is left out (a few scalars); the batch is counted as the model's input.",
        "One steady-state step: optimizer state exists, gradients are freed before the "
        "forward (zero_grad(set_to_none=True)), no gradient accumulation.",
    ]
    if optimizer is not None:
        state = "two fp32 moments" if "Adam" in type(optimizer).__name__ else "its state"
        out.append(f"Optimizer: {type(optimizer).__name__} with {state} per parameter, as configured.")
    else:
        out.append("No optimizer: forward and backward only.")
    if derived:
        out.append(
            "fp16 has bf16's element size and autocast op lists, so its numbers are bf16's "
            "(fp16 was not run separately)."
        )
    out += ([f.built] if f.built is not None else []) + f.fallbacks.lines()
    if f.stand_in:
        out.append(
            f"The {len(blocks)} blocks are identical: two ran, the rest passed their input "
            "through, and the peak adds up the per-block numbers (Profile's formula)."
        )
    if not blocks:
        out.append("No repeated blocks were found, so only 'none' checkpointing is estimated.")
    return out
