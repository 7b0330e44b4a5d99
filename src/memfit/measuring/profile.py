"""Per-block profile of one training step: memory, FLOPs and time under each checkpointing mode.

The planner needs to know, for every block, what checkpointing it saves and what it costs.
:class:`Profiler` measures that piece by piece, cheapest first, so a caller (the planner)
can stop where the rest cannot change its answer:

1. the optimizer's state, created by one step on zero gradients (no forward needed):
   parameters + gradients + optimizer state are then known;
2. one tracked step with no checkpointing: the measured peak, every block's memory, its
   FLOPs (FlopCounterMode), bytes written and ops dispatched, and which blocks form a
   plain chain (where segments may go); on the fake twin where the plain step does not
   fit, and for the planner wherever the twin runs (Note [one measuring path], twin.py);
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
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
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
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import cached_property
from typing import Any

import torch
from torch import nn

from memfit import progress
from memfit.budget import format_bytes
from memfit.checkpointing import (
    checkpointed_blocks,
    find_blocks,
    resolve_blocks,
    set_block_modes,
    uncheckpoint,
)  # fmt: skip
from memfit.checkpointing.segments import chain_probe
from memfit.devices import Room, model_device, room, room_needed, synchronize
from memfit.errors import InfeasibleBudget, OutOfMemory, is_out_of_memory
from memfit.measuring import block_timing as timing
from memfit.measuring.batchcheck import batch_errors, fake_logs_held, tensor_bytes
from memfit.measuring.block_timing import BlockInputs, block_times, capture_block_inputs
from memfit.measuring.depth import both, every_layer_runs, layer_drops
from memfit.measuring.flops import BlockFlops, block_flops, count_flops
from memfit.measuring.inplace import inplace_notes, watch_copies
from memfit.measuring.order import between_blocks, put_in_run_order, run_order
from memfit.measuring.phases import (
    StepMemory,
    optimizer_state_bytes,
    phased_step,
    profile_from_memory,
)
from memfit.measuring.preserve import create_optimizer_state, preserved
from memfit.measuring.prices import TimedSteps, fit_time_model
from memfit.measuring.repeated_blocks import mode_steps, skipping, stand_ins
from memfit.measuring.speed import device_speed, timing_threads, torch_threads
from memfit.measuring.split_timing import configured, split_counts, split_seconds, time_split_steps
from memfit.measuring.timing_lever import TimingLever
from memfit.measuring.twin import Twin, make_twin, twin_precision
from memfit.precision import Precision, as_precision
from memfit.records import Profile, Speed
from memfit.step import Batch, LossFn, batch_size, training_step
from memfit.stepmodel import simulate, time_note
from memfit.vocab import CHECKPOINT_MODES, CheckpointMode, PrecisionChoice

#: Times the heaviest block runs alone in each mode (after one untimed warm-up run).
BLOCK_ROUNDS = 8

_Optimizer = torch.optim.Optimizer
_Context = AbstractContextManager[Any]

__all__ = ["BLOCK_ROUNDS", "Profiler", "profile"]


class Profiler:
    """One model's step measured piece by piece (call inside ``preserved(model, optimizer)``).

    Attributes after each call are plain numbers; :meth:`result` assembles the
    :class:`memfit.records.Profile` from whatever was measured (modes not measured are absent).
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Batch,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer | None,
        precision: Precision,
        blocks: Sequence[str] | None = None,
    ) -> None:
        self.model, self.batch, self.loss_fn = model, batch, loss_fn
        self.optimizer, self.precision = optimizer, precision
        self.blocks = list(blocks) if blocks is not None else find_blocks(model)
        """The blocks measured (the caller's, else :func:`memfit.find_blocks`'s)."""
        self.memory: dict[CheckpointMode, StepMemory] = {}
        self.copied: dict[str, dict[str, set[str]]] = {}  # per mode and block: what in-place writes copied
        self.stand_in: dict[str, str] = {}
        self.links: list[bool] = []
        self.flops: dict[str, BlockFlops] = {}
        self.times: list[tuple[float, float, float]] = []
        self.block_times: dict[str, list[float]] = {}
        """Per checkpointing mode, ``timed_block``'s seconds alone, one per round, side by side."""
        self.split_times: dict[str, list[float]] = {}
        """The step's forward and backward whole and per count of micro-batches, one per round
        (:func:`~memfit.measuring.split_timing.time_split_steps`)."""
        self.timed_block = ""
        self.speed: Speed | None = None
        self.measured: list[str] = []
        """What was run, one line each (for the plan's report)."""
        self.room: Room | None = None
        """The device's room, read when the plain step is about to run."""
        self.twin: Twin | None = None
        self.twin_error = ""
        """Why the model could not run on a fake twin (then every step is real)."""
        self.estimate: StepMemory | None = None
        """The plain step under fake tensors."""
        self.fake = False
        """Memory is measured on the fake twin (the plain step does not fit, or :attr:`twin_memory`)."""
        self.twin_memory = False
        """Memory on the fake twin wherever it runs (the planner's; Note [one measuring path], twin.py)."""
        self.plain_in_room = True
        """The plain step fits the room (False: whole steps are timed in a configuration that does)."""
        self.timing: tuple[CheckpointMode, int] = ("none", 1)
        """The mode and micro-batches whole steps were timed in."""
        self.within: int | None = None
        """A peak real steps keep under where one can (the budget, where a search's answer
        is planned): the plain step over it is measured on the twin, and whole steps are
        timed in the cheapest configuration under it, else under the room
        (See Note [real steps within the budget] in memfit/planning/longest_sequence.py)."""
        self.failed: set[tuple[CheckpointMode, int, str]] = set()
        """Timing configurations (mode, micro-batches, lever) that ran out of memory."""
        self.lean: Callable[[], TimingLever | None] | None = None
        """Makes the lever whole steps may be timed with where no configuration without it
        fits (None: none may be; See Note [timing with a lever])."""
        self.timed_with: TimingLever | None = None  # the lever whole steps were timed with

    def phase(self, what: str, total: int | None = None) -> AbstractContextManager[progress.Phase]:
        """A progress phase named for this precision."""
        return progress.phase(f"{self.precision.mode}: {what}", total)

    def _subject(self, on_twin: bool) -> tuple[nn.Module, Batch, _Optimizer | None, Precision, _Context]:
        """What a memory step runs on: the fake twin (loss scaling off) or the real model."""
        twin = self.twin if on_twin else None  # See Note [random depth at its worst]
        if twin is None:
            return self.model, self.batch, self.optimizer, self.precision, every_layer_runs(self.model)
        context = both(twin.running(), every_layer_runs(twin.model))
        return twin.model, twin.batch, twin.optimizer, twin_precision(self.precision), context

    def _plain_step(self, on_twin: bool) -> StepMemory:
        """One tracked step without checkpointing (FLOPs counted), on the twin or the model."""
        model, batch, optimizer, precision, context = self._subject(on_twin)
        random_depth = bool(layer_drops(model))
        with context:
            create_optimizer_state(model, optimizer)
            uncheckpoint(model)
            model.train()
            # See Note [fake tensors first, real tensors where they fail]
            checked = batch_errors(model, batch) if not on_twin else nullcontext()
            with checked, chain_probe(model, self.blocks) as probe, run_order(model, self.blocks) as seen:
                mem = phased_step(model, batch, self.loss_fn, optimizer, precision, self.blocks)
            # See Note [blocks in the order they ran]
            self.blocks, self.links, keeps = put_in_run_order(
                self.blocks, seen, mem, [] if random_depth else probe.links, probe.keeps_shape
            )
            # only blocks proven residual (output shaped like the input) stand in for each other
            self.stand_in = stand_ins(model, self.blocks, keeps) if self.blocks else {}
            # FLOPs depend on shapes only: a real step after the twin's takes the twin's counts
            if on_twin or self.estimate is None:
                found = count_flops(model, batch, self.loss_fn, precision, self.stand_in)
                mem.forward_flops, mem.total_flops = found["forward"], found["total"]
            else:
                mem.forward_flops, mem.total_flops = self.estimate.forward_flops, self.estimate.total_flops
        return mem

    def estimated_peak(self) -> int | None:
        """The plain step's peak under fake tensors (nothing allocated), or None where the model
        cannot run on a fake twin (``twin_error`` says why); measured once and kept."""
        if self.twin is None and not self.twin_error:
            started = time.perf_counter()
            try:
                with self.phase("one step under fake tensors (nothing allocated)"), fake_logs_held():
                    self.twin = make_twin(self.model, self.optimizer, self.batch)
                    self.estimate = self._plain_step(on_twin=True)
            except Exception as exc:  # See Note [fake tensors first, real tensors where they fail]
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                self.twin, self.twin_error = None, f"{type(exc).__name__}: {first}"
                self.measured.append(
                    f"fake tensors cannot run {type(self.model).__name__} ({self.twin_error}): its steps "
                    "are measured for real"
                )
                return None
            seconds = time.perf_counter() - started
            self.measured.append(
                f"1 step at {self.precision.mode} without checkpointing under fake tensors, all "
                f"{len(self.blocks)} blocks, and its FLOPs counted in one of "
                f"{len(self.blocks) - len(self.stand_in)}, nothing allocated ({seconds:.2f} s)"
            )
        return self.estimate.peak if self.estimate is not None else None

    def plain_fits(self) -> bool:
        """Whether the plain step fits the device's room now (unknown: True), kept in ``plain_in_room``."""
        peak = self.estimated_peak()
        if self.room is None:  # See Note [room after the fake step]
            self.room = room(model_device(self.model))
        if peak is None or self.estimate is None:
            fits = True
        elif self.within is not None and peak > self.within:  # See Note [real steps within the budget]
            fits = False
        else:
            fits = self.room is None or self.room.fits(peak - self.estimate.start)
        self.plain_in_room = fits
        return fits

    def none(self) -> StepMemory:
        """The plain step's memory, FLOPs and chain links: tracked for real where it fits the
        device's room and :attr:`twin_memory` is off, else under fake tensors (``fake`` is then
        True)."""
        create_optimizer_state(self.model, self.optimizer)
        if self.plain_fits() and self.twin_memory and self.estimate is not None:
            return self.use_estimate()  # See Note [one measuring path] in memfit/measuring/twin.py
        if self.plain_in_room:
            started = time.perf_counter()
            try:
                with self.phase("one tracked step without checkpointing"):
                    mem = self._plain_step(on_twin=False)
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                if self.estimate is None:
                    raise OutOfMemory(self._full_message(exc)) from None
                uncheckpoint(self.model)
                self.failed.add(("none", 1, ""))
                self.plain_in_room = False
                self.measured.append(
                    "the step without checkpointing ran out of memory: measured under fake tensors"
                )
                return self.use_estimate()
            counted = "FLOPs from the fake step" if self.estimate is not None else "FLOPs counted"
            self.measured.append(
                f"1 tracked step at {self.precision.mode} without checkpointing, all {len(self.blocks)} "
                f"blocks, {counted} ({time.perf_counter() - started:.2f} s)"
            )
            self.memory["none"] = mem
            self.flops = block_flops(
                mem.forward_flops, mem.total_flops, type(self.model).__name__, self.blocks
            )
            return mem
        assert self.estimate is not None
        where = (
            f"the room of {format_bytes(self.room.free)} ({self.room.source})"
            if self.room is not None and not self.room.fits(self.estimate.peak - self.estimate.start)
            else f"the budget of {format_bytes(self.within or 0)}"
        )
        self.measured.append(
            f"the step without checkpointing ({format_bytes(self.estimate.peak)} under fake tensors) does "
            f"not fit {where}: steps' memory is measured under fake tensors"
        )
        return self.use_estimate()

    def use_estimate(self) -> StepMemory:
        """Take the fake-tensor plain step (:meth:`estimated_peak` ran) as the plain step's memory:
        every later memory step runs on the twin."""
        mem = self.estimate
        assert mem is not None
        self.memory["none"], self.fake = mem, True
        self.flops = block_flops(mem.forward_flops, mem.total_flops, type(self.model).__name__, self.blocks)
        return mem

    def _full_message(self, exc: BaseException) -> str:
        free = format_bytes(self.room.free) if self.room is not None else "unknown"
        why = f" and fake tensors could not run it ({self.twin_error})" if self.twin_error else ""
        return (
            f"the step without checkpointing ran out of memory on {model_device(self.model)} (room "
            f"{free}){why}: plan with a smaller batch (memfit scales a plan's micro-batches) or "
            f"free the device ({type(exc).__name__})."
        )

    def modes(self, modes: Sequence[CheckpointMode]) -> None:
        """One step per mode, identical blocks run once (the others pass through): tracked, or
        on the fake twin where :meth:`none` measured there."""
        modes = [m for m in modes if m not in self.memory]
        active = [b for b in self.blocks if b not in self.stand_in]
        model, batch, optimizer, precision, context = self._subject(self.fake)
        started = time.perf_counter()
        how = "fake-tensor" if self.fake else "tracked"
        shown = self.phase(f"{how} steps per checkpointing mode", len(modes))  # none: no line

        def watched(mode: CheckpointMode) -> AbstractContextManager[object]:
            return watch_copies(model, active, self.copied.setdefault(mode, {}))

        with context, skipping(model, list(self.stand_in)), shown as ph:
            step = (batch, self.loss_fn)
            self.memory.update(mode_steps(model, step, optimizer, precision, active, modes, ph, watched))
            uncheckpoint(model)
        if modes:
            self.measured.append(
                f"{len(modes)} {how} step(s) at {self.precision.mode} ({', '.join(modes)}), "
                f"{len(active)} of {len(self.blocks)} blocks run ({time.perf_counter() - started:.2f} s)"
            )

    def _timing_config(self) -> tuple[CheckpointMode, int]:
        """The (mode, micro-batches) whole steps are timed in: the plain step where it fits,
        else split into the fewest micro-batches that fit, else fully checkpointed; sets
        :attr:`timed_with` to the lever they are timed with (None: none).

        See Note [timing a step that does not fit] and Note [timing with a lever] in
        memfit/measuring/timing_lever.py.
        """
        self.timed_with = None
        if ("none", 1, "") not in self.failed and self.plain_in_room:
            return "none", 1
        if "full" not in self.memory and self.blocks:
            self.modes([m for m in CHECKPOINT_MODES if m != "none"])
        prof = self._memory_profile()
        start, rows = self.memory["none"].start, batch_size(self.batch)
        room = self.room
        in_room: Callable[[int], bool] = lambda peak: room is None or room.fits(peak - start)  # noqa: E731
        tries: list[tuple[Callable[[int], bool], bool]] = [(in_room, False), (in_room, True)]
        if self.within is not None:  # See Note [real steps within the budget]
            within = self.within
            tries = [(lambda peak: peak <= within, False), (lambda peak: peak <= within, True), *tries[::-1]]
        for fits, with_lever in tries:
            lever = self._lean_lever if with_lever else None
            if with_lever and lever is None:
                continue
            found = self._fewest_parts(lever.predict(prof) if lever else prof, rows, fits, lever)
            if found is not None:
                self.timed_with = lever
                return found
        least = simulate(prof, "full" if self.blocks else "none", rows).peak_bytes
        free = self.room.free if self.room is not None else 0
        where = f"{format_bytes(free)} ({self.room.source})" if self.room is not None else "unknown"
        raise InfeasibleBudget(
            f"no step of {type(self.model).__name__} on this batch fits {model_device(self.model)}'s room of "
            f"{where}: its smallest, one sample at a time with every block checkpointed, needs "
            f"{format_bytes(least)} ({format_bytes(room_needed(max(0, least - start)))} more with memfit's "
            "margin); free the device or use a smaller model or sequence.",
            minimum_bytes=least,
            budget_bytes=start + free,
        )

    @cached_property
    def _lean_lever(self) -> TimingLever | None:  # made once
        return self.lean() if self.lean is not None else None

    def _fewest_parts(
        self, prof: Profile, rows: int, fits: Callable[[int], bool], lever: TimingLever | None = None
    ) -> tuple[CheckpointMode, int] | None:
        """The plain step in the fewest micro-batches whose peak ``fits``, else every block fully
        checkpointed in the fewest (None: none fits)."""
        modes: list[CheckpointMode] = (
            [m for m in CHECKPOINT_MODES if m != "selective"] if self.blocks else ["none"]
        )
        name = lever.name if lever is not None else ""
        for mode in modes:
            k = 2 if mode == "none" and lever is None else 1
            while k <= rows:
                if fits(simulate(prof, mode, k).peak_bytes) and (mode, k, name) not in self.failed:
                    return mode, k
                k *= 2
        return None

    def _timed(self, mode: CheckpointMode, micro_batches: int = 1) -> tuple[float, float, float]:
        """(forward, backward, whole) seconds of one step with every block in ``mode``."""
        with configured(self.model, self.blocks, mode, self.timed_with):
            return self._timed_as_set(micro_batches)

    def _timed_as_set(self, micro_batches: int) -> tuple[float, float, float]:
        """:meth:`_timed` with the blocks' modes and the lever as they are set."""
        device = model_device(self.model)
        marks: dict[str, float] = {}

        def mark(name: str) -> None:
            synchronize(device)
            marks[name] = time.perf_counter()

        mark("start")
        m, b, lf, opt, prec = self.model, self.batch, self.loss_fn, self.optimizer, self.precision
        fwd, bwd = (lambda: mark("forward")), (lambda: mark("backward"))
        training_step(m, b, lf, opt, prec, micro_batches, after_forward=fwd, after_backward=bwd)
        mark("end")
        forward = (marks["forward"] - marks["start"]) * micro_batches  # the first part's, times the parts
        return forward, marks["backward"] - marks["start"] - forward, marks["end"] - marks["start"]

    def _timed_steps(self, n: int, capture: str = "") -> tuple[list[tuple[float, float, float]], BlockInputs]:
        """``n`` timed steps in the timing configuration, keeping block ``capture``'s inputs; a
        configuration that runs out of memory (what the estimate did not see: libraries loaded,
        the allocator's slack) gives way to the next smaller one."""
        while True:
            self.timing = self._timing_config()
            try:
                with (
                    capture_block_inputs(self.model, capture)
                    if capture
                    else nullcontext(BlockInputs()) as seen,
                    self.phase(f"timing whole steps{self._described()}", n) as ph,
                    every_layer_runs(self.model),
                    batch_errors(self.model, self.batch),  # the first real step where memory was fake
                ):
                    return [self._timed(*self.timing) for _ in ph.over(range(n))], seen
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                uncheckpoint(self.model)
                self.failed.add((*self.timing, self.timed_with.name if self.timed_with else ""))
                self.measured.append(
                    f"a step timed{self._described() or ' without checkpointing'} ran out "
                    "of memory: timing a smaller one"
                )

    def _described(self) -> str:
        return timing.describe_timing(*self.timing, self.timed_with.described if self.timed_with else "")

    def time(self, repeats: int) -> None:
        """Time ``repeats`` whole steps (plain where it fits), and micro-benchmark the device."""
        started = time.perf_counter()
        cold = self.fake and not self.times  # no real step ran: the first one warms up, untimed
        self.times += self._timed_steps(repeats + cold)[0][cold:]
        with self.phase("micro-benchmarks of the device"):
            self.speed = device_speed(model_device(self.model), self.precision)
        self.measured.append(
            f"{repeats} timed step(s) at {self.precision.mode}{self._described()}{' after 1 untimed' * cold} "
            f"and micro-benchmarks ({time.perf_counter() - started:.2f} s)"
        )

    def time_checkpointed(self, steps: int, rounds: int = BLOCK_ROUNDS) -> None:
        """Time ``steps`` more whole steps at least (as :meth:`time` does), the step in micro-batches
        (splitting's price; its rounds' whole runs are those steps) and the heaviest distinct block
        alone ``rounds`` times per mode side by side (a recompute's and selective's prices)."""
        if not self.blocks:
            return
        started, before = time.perf_counter(), len(self.times)
        distinct = [b for b in self.blocks if b not in self.stand_in] or self.blocks
        heaviest = max(distinct, key=lambda b: self.flops.get(b, BlockFlops()).forward)
        first, seen = self._timed_steps(1, heaviest)
        self.times += first  # See Note [timing a block alone within a few steps]
        within = timing.BLOCK_STEPS * statistics.median(t[2] for t in self.times)
        split = self._time_split(first[0], rounds, within)
        if len(self.times) - before < steps:  # too few rounds (or none) were timed
            self.times += self._timed_steps(steps - len(self.times) + before)[0]
        what = f"{len(self.times) - before} timed step(s) at {self.precision.mode}{self._described()}{split}"
        modes = [m for m in CHECKPOINT_MODES if m == "none" or m in self.memory]
        alone = (self.model, heaviest, seen, modes, rounds, self.precision.autocast, within)
        found, why = block_times(*alone) if len(modes) > 1 else ({}, "")
        if why:
            what += f"; {heaviest} could not run alone ({why}): the micro-benchmark's prices stand"
        elif found:
            self.timed_block, self.block_times = heaviest, found
            what += f"; {heaviest} alone {len(found['none'])} times in each of {', '.join(modes)}"
        self.measured.append(f"{what} ({time.perf_counter() - started:.2f} s)")

    def _time_split(self, first: tuple[float, float, float], rounds: int, within: float) -> str:
        """Time the step whole and in micro-batches into ``split_times``, each round's whole run a
        timed step kept in ``times`` (the first round's is ``first``, just run); what was timed.
        See Note [a split round's whole run is a timed step]."""
        mode, parts = self.timing  # the step split: its counts are of the timed micro-batch's rows
        counts = split_counts(-(-batch_size(self.batch) // parts))
        ran = iter([first])

        def timed(k: int) -> float:
            if k > 1:
                return split_seconds(self.model, self.batch, self.loss_fn, self.precision, parts * k)
            step = next(ran, None)
            if step is None:  # a later round: its whole run is a new timed step
                step = self._timed_as_set(parts)
                self.times.append(step)
            return step[0] + step[1]

        with configured(self.model, self.blocks, mode, self.timed_with), every_layer_runs(self.model):
            self.split_times, why = time_split_steps(timed, counts, rounds, within)
        if why:
            return f"; the step could not be split ({why}): micro-batches priced by their ops"
        if not self.split_times:
            return ""
        n = len(self.split_times["none"])
        return f", the step in {' and '.join(map(str, counts))} micro-batches {n} times alongside"

    def _memory_profile(self) -> Profile:
        model = self.twin.model if self.fake and self.twin is not None else self.model
        return profile_from_memory(
            model, self.blocks, self.memory, self.precision.mode, batch_size(self.batch), self.stand_in
        )

    def result(self) -> Profile:
        """The :class:`memfit.records.Profile` of what was measured."""
        prof = self._memory_profile()
        prof.chain_links = list(self.links)
        between_blocks(self.memory["none"], prof.blocks)
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
        prof.memory_from = "fake tensors" if self.fake else "tracked"
        prof.plain_fits = self.plain_in_room
        if self.times:
            prof.step_seconds = statistics.median(t[2] for t in self.times)
        if self.speed is not None and self.times:
            self._fit_time_model(prof)
        prof.notes = ([time_note(prof)] if prof.speed is not None else []) + list(self.notes())
        prof.notes += inplace_notes(self.copied, self.stand_in, self.blocks)
        return prof

    def _fit_time_model(self, prof: Profile) -> None:
        """Scale the counted work to the timed steps and fit the prices to the block timed alone
        (see Note [timing a step that does not fit])."""
        assert self.speed is not None
        moved = self.timed_with.moved_flops if self.timed_with is not None else 0.0
        steps = TimedSteps(self.times, *self.timing, self._described().strip(), moved)
        fit_time_model(prof, self.speed, steps, self.timed_block, self.block_times, self.split_times)

    def notes(self) -> list[str]:
        name = type(self.model).__name__
        why = "find_blocks found none); it is profiled as one part, 'outside', and checkpointing cannot"
        return [] if self.blocks else [f"{name} has no repeated blocks ({why} be planned for it."]


def profile(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None = None,
    precision: PrecisionChoice | str | Precision = "fp32",
    repeats: int = 3,
    blocks: str | Sequence[str] | None = None,
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
        blocks: the blocks to profile (names or class names, as :func:`memfit.checkpoint`
            takes them); default: :func:`memfit.find_blocks`'s.

    Returns:
        A :class:`memfit.records.Profile` (see its docstring for what each number means).

    Raises:
        ConfigError: the batch does not fit the model (one step on it fails), or a block is unknown.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    prec = as_precision(precision, device=model_device(model))
    names = None if blocks is None else resolve_blocks(model, blocks)
    original, scaler_state = checkpointed_blocks(model), prec.scaler.state_dict()
    threads, _ = timing_threads(model_device(model))  # See Note [timing on the free cores]
    try:
        with torch_threads(threads), preserved(model, optimizer):
            prof = Profiler(model, batch, loss_fn, optimizer, prec, names)
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
