"""Per-block profile of one training step: memory, FLOPs and time under each checkpointing mode.

The planner needs to know, for every block, what checkpointing it saves and what it costs.
:class:`Profiler` measures that piece by piece, cheapest first, so a caller (the planner)
can stop where the rest cannot change its answer:

1. the optimizer's state, created by one step on zero gradients (no forward needed):
   parameters + gradients + optimizer state are then known;
2. one tracked step with no checkpointing: the measured peak, every block's memory, its
   FLOPs (FlopCounterMode), bytes written and ops dispatched, and which blocks form a
   plain chain (where segments may go);
3. one tracked step per checkpointing mode, in which identical blocks run once
   (:mod:`memfit.measuring.repeated_blocks`): the others pass their input through;
4. a few timed steps and micro-benchmarks (:mod:`memfit.measuring.speed`) for the time
   model (:mod:`memfit.stepmodel.time`), and the heaviest distinct block timed alone per
   mode (:mod:`memfit.measuring.block_timing`) for a recompute's and selective's prices.

Trade-off: per-block times are modelled from counted work scaled to the timed steps, not
timed block by block: hook timings on a CPU are dominated by hook overhead, and timings
of a shared machine differ run to run; counts do not.

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
from collections.abc import Sequence

import torch
from torch import nn

from memfit.checkpointing import checkpointed_blocks, find_blocks, set_block_modes, uncheckpoint
from memfit.measuring.assemble import profile_from_memory
from memfit.measuring.batchcheck import batch_errors, tensor_bytes
from memfit.measuring.block_timing import block_extras, capture_block_inputs, fit_prices
from memfit.measuring.flops import BlockFlops, block_flops
from memfit.measuring.inplace import inplace_notes, watch_copies
from memfit.measuring.phases import StepMemory, grad_bytes_of, optimizer_state_bytes, phased_step
from memfit.measuring.preserve import create_optimizer_state, preserved
from memfit.measuring.repeated_blocks import skipping, stand_ins
from memfit.measuring.speed import measure_speed
from memfit.measuring.tracker import device_of
from memfit.precision import Precision, as_precision
from memfit.records import Profile, Speed
from memfit.segments import chain_probe
from memfit.step import Batch, LossFn, batch_size, training_step
from memfit.stepmodel import fill_times, forward_work, simulate, time_note
from memfit.vocab import CHECKPOINT_MODES

#: Times the heaviest block runs alone in each mode (after one untimed warm-up run).
BLOCK_ROUNDS = 8

__all__ = ["BLOCK_ROUNDS", "Profiler", "create_optimizer_state", "profile", "profile_from_memory"]


class Profiler:
    """One model's step measured piece by piece (call inside ``preserved(model, optimizer)``).

    Attributes after each call are plain numbers; :meth:`result` assembles the
    :class:`memfit.Profile` from whatever was measured (modes not measured are absent).
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Batch,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer | None,
        precision: Precision,
    ) -> None:
        self.model, self.batch, self.loss_fn, self.optimizer, self.precision = (
            model,
            batch,
            loss_fn,
            optimizer,
            precision,
        )
        self.blocks = find_blocks(model)
        self.memory: dict[str, StepMemory] = {}
        self.copied: dict[str, dict[str, set[str]]] = {}  # per mode and block: what in-place writes copied
        self.stand_in: dict[str, str] = {}
        self.links: list[bool] = []
        self.flops: dict[str, BlockFlops] = {}
        self.times: list[tuple[float, float, float]] = []
        self.extras: dict[str, list[float]] = {}
        """Per checkpointing mode, ``timed_block``'s seconds over none's, one per round."""
        self.timed_block = ""
        self.speed: Speed | None = None
        self.measured: list[str] = []
        """What was run, one line each (for the plan's report)."""

    def none(self) -> StepMemory:
        """One tracked step without checkpointing: memory, FLOPs, chain links (the batch is checked)."""
        create_optimizer_state(self.model, self.optimizer)
        uncheckpoint(self.model)
        self.model.train()
        started = time.perf_counter()
        with batch_errors(self.model, self.batch), chain_probe(self.model, self.blocks) as probe:
            mem = phased_step(
                self.model,
                self.batch,
                self.loss_fn,
                self.optimizer,
                self.precision,
                self.blocks,
                count_flops=True,
            )
        self.memory["none"] = mem
        self.links = probe.links
        # NOTE: only blocks proven residual (output shaped like the input) stand in for each other
        self.stand_in = stand_ins(self.model, self.blocks, probe.keeps_shape) if self.blocks else {}
        self.flops = block_flops(mem.forward_flops, mem.total_flops, type(self.model).__name__, self.blocks)
        self.measured.append(
            f"1 tracked step at {self.precision.mode} without checkpointing, all {len(self.blocks)} blocks, "
            f"FLOPs counted ({time.perf_counter() - started:.2f} s)"
        )
        return mem

    def quick_peak(self) -> int | None:
        """The no-checkpointing peak from a step that runs only the distinct blocks (an estimate).

        Worth it where most blocks are identical (two thirds or more would pass through);
        None otherwise, or when a block that ran is not residual after all. The estimate
        lets a hopeless fraction budget be refused before a whole tracked step.
        """
        if not self.blocks:
            return None
        skipped = stand_ins(self.model, self.blocks, [True] * len(self.blocks))
        if 3 * len(skipped) < 2 * len(self.blocks):
            return None
        create_optimizer_state(self.model, self.optimizer)
        uncheckpoint(self.model)
        active = [b for b in self.blocks if b not in skipped]
        started = time.perf_counter()
        with (
            skipping(self.model, list(skipped)),
            batch_errors(self.model, self.batch),
            chain_probe(self.model, active) as probe,
        ):
            mem = phased_step(self.model, self.batch, self.loss_fn, self.optimizer, self.precision, active)
        self.measured.append(
            f"1 tracked step at {self.precision.mode} of {len(active)} of {len(self.blocks)} blocks, to "
            f"estimate the peak ({time.perf_counter() - started:.2f} s)"
        )
        if not all(probe.keeps_shape):
            return None
        prof = profile_from_memory(
            self.model, self.blocks, {"none": mem}, self.precision.mode, batch_size(self.batch), skipped
        )
        prof.grad_bytes = grad_bytes_of(self.model)
        return simulate(prof, "none").peak_bytes

    def modes(self, modes: Sequence[str]) -> None:
        """One tracked step per mode, identical blocks run once (the others pass through)."""
        active = [b for b in self.blocks if b not in self.stand_in]
        started = time.perf_counter()
        with skipping(self.model, list(self.stand_in)):
            for mode in modes:
                set_block_modes(self.model, {b: mode for b in active})
                with watch_copies(self.model, active, self.copied.setdefault(mode, {})):
                    self.memory[mode] = phased_step(
                        self.model,
                        self.batch,
                        self.loss_fn,
                        self.optimizer,
                        self.precision,
                        active,
                        step_optimizer=False,
                    )
        uncheckpoint(self.model)
        if modes:
            self.measured.append(
                f"{len(modes)} tracked step(s) at {self.precision.mode} ({', '.join(modes)}), "
                f"{len(active)} of {len(self.blocks)} blocks run ({time.perf_counter() - started:.2f} s)"
            )

    def _timed(self, mode: str) -> tuple[float, float, float]:
        """(forward, backward, whole) seconds of one step with every block in ``mode``."""
        device = device_of(self.model)
        marks: dict[str, float] = {}

        def mark(name: str) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            marks[name] = time.perf_counter()

        uncheckpoint(self.model)
        if mode != "none":
            set_block_modes(self.model, dict.fromkeys(self.blocks, mode))
        mark("start")
        training_step(
            self.model,
            self.batch,
            self.loss_fn,
            self.optimizer,
            self.precision,
            after_forward=lambda: mark("forward"),
            after_backward=lambda: mark("backward"),
        )
        mark("end")
        uncheckpoint(self.model)
        return (
            marks["forward"] - marks["start"],
            marks["backward"] - marks["forward"],
            marks["end"] - marks["start"],
        )

    def time(self, repeats: int) -> None:
        """Time ``repeats`` whole steps without checkpointing, and micro-benchmark the device."""
        started = time.perf_counter()
        self.times += [self._timed("none") for _ in range(repeats)]
        self.speed = measure_speed(device_of(self.model), self.precision)
        self.measured.append(
            f"{repeats} timed step(s) at {self.precision.mode} and micro-benchmarks "
            f"({time.perf_counter() - started:.2f} s)"
        )

    def time_checkpointed(self, steps: int, rounds: int = BLOCK_ROUNDS) -> None:
        """Time ``steps`` more whole steps without checkpointing, and the heaviest distinct
        block alone, ``rounds`` times in each measured mode side by side: what a recompute
        and selective checkpointing cost on this model (a whole step's noise is as large as
        one block's recompute)."""
        if not self.blocks:
            return
        started = time.perf_counter()
        distinct = [b for b in self.blocks if b not in self.stand_in] or self.blocks
        heaviest = max(distinct, key=lambda b: self.flops.get(b, BlockFlops()).forward)
        with capture_block_inputs(self.model, heaviest) as seen:
            self.times += [self._timed("none") for _ in range(max(1, steps))]
        modes = [m for m in CHECKPOINT_MODES if m == "none" or m in self.memory]
        extras, why = (
            ({}, "")
            if len(modes) == 1
            else block_extras(self.model, heaviest, seen, modes, rounds, self.precision.autocast)
        )
        what = f"{max(1, steps)} timed step(s) at {self.precision.mode}"
        if why:
            what += f"; {heaviest} could not run alone ({why}): the micro-benchmark's prices stand"
        elif extras:
            self.timed_block, self.extras = heaviest, extras
            what += f" and {heaviest} alone {rounds} times in each of {', '.join(modes)}"
        self.measured.append(f"{what} ({time.perf_counter() - started:.2f} s)")

    def result(self) -> Profile:
        """The :class:`memfit.Profile` of what was measured."""
        prof = profile_from_memory(
            self.model, self.blocks, self.memory, self.precision.mode, batch_size(self.batch), self.stand_in
        )
        prof.chain_links = list(self.links)
        for st in [*prof.blocks, prof.outside]:
            f = self.flops.get(st.name, BlockFlops())
            st.forward_flops, st.selective_flops = f.forward, f.selective_recompute
            st.backward_flops = {
                m: f.backward + {"none": 0, "selective": f.selective_recompute, "full": f.forward}.get(m, 0)
                for m in st.saved_bytes
            }
        prof.optimizer = type(self.optimizer).__name__ if self.optimizer is not None else "none"
        prof.optimizer_bytes_by_dtype = optimizer_state_bytes(self.optimizer)
        prof.input_bytes = tensor_bytes(self.batch)
        prof.measured_peak_bytes = self.memory["none"].peak
        if self.times:
            fwd, bwd, step = (statistics.median(t[k] for t in self.times) for k in range(3))
            prof.step_seconds = step
        if self.speed is not None and self.times:
            sp = Speed(**{**self.speed.to_dict(), "timed_steps": len(self.times)})
            prof.speed = sp
            work = sum(forward_work(prof, b) for b in [*prof.blocks, prof.outside]) or 1.0
            sp.forward_scale, sp.backward_scale = fwd / work, bwd / work
            if self.extras:
                fit_prices(prof, self.timed_block, self.extras)
            fill_times(prof)
        prof.notes = ([time_note(prof)] if prof.speed is not None else []) + list(self.notes())
        prof.notes += inplace_notes(self.copied, self.stand_in, self.blocks)
        return prof

    def notes(self) -> list[str]:
        if self.blocks:
            return []
        return [
            f"{type(self.model).__name__} has no repeated blocks (find_blocks found none); it is profiled "
            "as one part, 'outside', and checkpointing cannot be planned for it."
        ]


def profile(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None = None,
    precision: str | Precision = "fp32",
    repeats: int = 3,
) -> Profile:
    """Profile each block's memory, time and FLOPs under none, selective and full checkpointing.

    Every memory number for mode ``m`` comes from a step with every block in mode ``m``
    (identical blocks measured once); the model's own checkpointing, weights, gradients,
    optimizer state and RNG are restored afterwards. A model without repeated blocks is
    profiled as one part (``outside``), with a warning.

    Args:
        model: the model, on its device.
        batch: a tensor or tuple of tensors whose first dimension is the batch.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        optimizer: its state and step are part of the step (None: forward and backward only).
        precision: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"auto"`` or a Precision.
        repeats: whole steps timed for the time model; medians are reported.

    Returns:
        A :class:`memfit.Profile` (see its docstring for what each number means).

    Raises:
        ConfigError: the batch does not fit the model (one step on it fails).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    prec = as_precision(precision, device=device_of(model))
    original = checkpointed_blocks(model)
    scaler_state = prec.scaler.state_dict()
    try:
        with preserved(model, optimizer):
            prof = Profiler(model, batch, loss_fn, optimizer, prec)
            for note in prof.notes():
                warnings.warn(note, stacklevel=2)
            prof.none()
            if prof.blocks:
                prof.modes([m for m in CHECKPOINT_MODES if m != "none"])
            prof.time(repeats)
            prof.time_checkpointed(repeats)
            result = prof.result()
    finally:
        uncheckpoint(model)
        if original:
            set_block_modes(model, original)
        if scaler_state:
            prec.scaler.load_state_dict(scaler_state)
    return result
