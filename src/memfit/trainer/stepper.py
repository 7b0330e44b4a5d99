"""One training step as the Trainer runs it: guarded, memory-tracked, and retried after running out of memory.

:class:`Stepper` is the part of :class:`memfit.Trainer` that runs a single step: the
precision and micro-batches (from the plan), the overflow guard, memory tracking, and the
out-of-memory recovery of :mod:`memfit.trainer.oom`. The Trainer adds the loop, callbacks,
evaluation and training state.

Trade-off: on a CPU, tracking a step's memory with MemTracker slows that step down, so
the first steady-state step (optimizer state already created) is tracked, then every
``memory_every`` steps, and again after a re-plan; on a GPU the allocator's peak is read on
every step for free.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 1)
    >>> stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1),
    ...                   lambda m, b: m(b).pow(2).mean(), "fp32")
    >>> outcome = stepper.run_step(torch.ones(2, 4))
    >>> outcome.result.samples, outcome.tracked, stepper.step_count
    (2, False, 0)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from memfit.check.guards import Guard, GuardConfig
from memfit.checkpointing import checkpointed_blocks, refuse_double_checkpointing
from memfit.checkpointing.compile import is_compiled
from memfit.devices import model_device, synchronize, unwrap
from memfit.errors import ConfigError, InfeasibleBudget, OutOfMemory, is_out_of_memory
from memfit.loop import planned_step, prepare, prepared
from memfit.measuring.tracker import MemoryWatch
from memfit.precision import Precision, as_precision
from memfit.records import MemoryReport, Plan
from memfit.step import Batch, LossFn, StepResult
from memfit.trainer.distributed import DistContext, global_mean, local_batch
from memfit.trainer.oom import (
    OomConfig,
    ReplanEvent,
    StepSnapshot,
    describe_plan,
    refusal,
    replan,
)
from memfit.vocab import PrecisionChoice

__all__ = ["StepOutcome", "Stepper", "check_plan_applied", "to_device"]


@dataclass
class StepOutcome:
    """What one step did: its result, its peak bytes (None: not known), whether MemTracker
    watched it, and the seconds of the attempt that succeeded."""

    result: StepResult
    peak_bytes: int | None
    tracked: bool
    seconds: float


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch (a tensor, or a tuple or list of them) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(t, device) for t in batch)
    return batch


def check_plan_applied(
    plan: Plan, precision: PrecisionChoice | Precision | None, micro_batches: int | None
) -> None:
    """Refuse arguments that contradict ``plan`` (the Trainer applies the plan itself, with
    :func:`memfit.prepare`).

    Raises:
        ConfigError: naming the contradiction and the fix.
    """
    asked = precision.mode if isinstance(precision, Precision) else precision
    if asked is not None and asked != plan.precision:
        raise ConfigError(
            f"precision {asked!r} contradicts the plan's {plan.precision!r}; pass one of them, not both."
        )
    if micro_batches is not None and micro_batches != plan.micro_batches:
        raise ConfigError(
            f"micro_batches={micro_batches} contradicts the plan's {plan.micro_batches}; pass one of them."
        )


class Stepper:
    """Runs one training step at a time; see :class:`memfit.Trainer` for the arguments.

    ``save_last_good`` is called to write the state from before a step that cannot go on
    (a non-finite loss, or running out of memory with no plan that fits); it returns where.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        precision: PrecisionChoice | Precision | None = None,
        plan: Plan | None = None,
        *,
        micro_batches: int | None = None,
        clip_norm: float | None = None,
        memory_every: int = 0,
        track_memory: bool = True,
        dist: DistContext | None = None,
        guard: GuardConfig | None = None,
        oom: OomConfig | None = None,
        save_last_good: Callable[[], Path] | None = None,
        compile: bool = False,
    ) -> None:
        self.dist = dist or DistContext()
        self.model = model
        if checkpointed_blocks(unwrap(model)):
            refuse_double_checkpointing(unwrap(model))
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.device = model_device(model)
        asked: str | Precision = "auto" if precision is None else precision
        if plan is not None:
            check_plan_applied(plan, precision, micro_batches)
            asked = precision if precision is not None else plan.precision
            micro_batches = micro_batches if micro_batches is not None else plan.micro_batches
        self.plan = plan
        self.precision = as_precision(asked, device=self.device)  # its fp32 modules: memfit.apply
        self.micro_batches = 1 if micro_batches is None else int(micro_batches)
        if self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be at least 1, got {micro_batches!r}.")
        if clip_norm is not None and not clip_norm > 0:
            raise ConfigError(f"clip_norm must be positive (or None for no clipping), got {clip_norm!r}.")
        self.clip_norm = clip_norm
        # Every step is memfit.loop.planned_step of this plan (memfit.train_step's own step);
        # without a plan, the model's checkpointing, precision and micro-batches are one.
        self._running = plan or Plan(
            blocks=dict(checkpointed_blocks(unwrap(model))),
            precision=self.precision.mode,
            micro_batches=self.micro_batches,
        )
        # A plan whose levers change the optimizer state's precision trains a new optimizer.
        _, self.optimizer = prepare(
            model, optimizer, self._running, precision=self.precision, compile=compile
        )
        self.memory_every = memory_every
        self.track_memory = track_memory
        self.memory_note: str | None = None
        """Why memory is not tracked, when that is not the caller's choice."""
        if is_compiled(model) and track_memory:
            # MemTracker sees no inductor buffers, and tracking runs the model eagerly: a compiled
            # step has only the CUDA allocator's peak.
            # See Note [measuring compiled models eagerly]
            self.track_memory = False
            self.memory_note = (
                "compiled: each step's peak is the CUDA allocator's (MemTracker does not see "
                "inductor's buffers)"
                if self.device.type == "cuda"
                else "compiled on CPU: step memory is not tracked (MemTracker does not see inductor's "
                "buffers); the plan's prediction, from the eager step, stands"
            )
        self.step_count = 0
        self.memory: MemoryReport | None = None
        """The breakdown of the last tracked steady-state step."""
        self._write_last_good = save_last_good
        self.guard = Guard(guard or GuardConfig(), save_state=save_last_good)
        """The overflow guard; ``.guard.events`` lists what it saw and did."""
        self.oom = oom or OomConfig()
        self.replans: list[ReplanEvent] = []
        """The re-plans after out-of-memory steps, in order."""

    def _track_this_step(self) -> bool:
        # A step is steady once optimizer state exists (Adam's moments are created lazily by
        # the first step) or a step was taken (SGD without momentum has no state at all).
        steady = self.step_count > 0 or len(self.optimizer.state) > 0
        if not steady or not self.track_memory:
            return False
        if self.memory is None:
            return True
        return self.memory_every > 0 and (self.step_count + 1) % self.memory_every == 0

    def _guarded_step(self, batch: Batch) -> StepResult:
        result, self.precision = self.guard.step(
            self.model,
            batch,
            self.loss_fn,
            self.optimizer,
            self.precision,
            self.step_count + 1,
            self.micro_batches,
            self.clip_norm,
            run=lambda loss_fn, precision: self._planned_step(batch, loss_fn, precision),
        )
        return result

    def _planned_step(self, batch: Batch, loss_fn: LossFn, precision: Precision) -> StepResult:
        if precision is not prepared(self.optimizer).precision:
            # The guard fell back to another precision: this step and the next run it.
            self._running = dataclasses.replace(self._running, precision=precision.mode)
            _, self.optimizer = prepare(self.model, self.optimizer, self._running, precision=precision)
        return planned_step(
            self.model, batch, loss_fn, self.optimizer, self._running, clip_norm=self.clip_norm
        )

    def _run(self, batch: Batch) -> tuple[StepResult, int | None, bool]:
        """Run the step; return its result, its peak bytes (if known) and whether MemTracker watched."""
        if self._track_this_step():
            with MemoryWatch(self.model, self.optimizer) as watch:
                result = self._guarded_step(batch)
            self.memory = MemoryReport(
                peak_bytes=watch.peak_bytes,
                breakdown=dict(watch.breakdown),
                device=str(self.device),
                precision=self.precision.mode,
                tracker="cuda-allocator" if self.device.type == "cuda" else "MemTracker",
            )
            return result, watch.peak_bytes, True
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            result = self._guarded_step(batch)
            return result, int(torch.cuda.max_memory_allocated(self.device)), False
        return self._guarded_step(batch), None, False

    def _run_global(self, batch: Batch) -> tuple[StepResult, int | None, bool]:
        """One step on this rank's slice; loss, samples and tokens are for the global batch."""
        result, peak, tracked = self._run(local_batch(batch, self.dist))
        if self.dist.active:
            result.loss = global_mean(result.loss, self.dist)
            result.samples *= self.dist.world_size
            result.tokens *= self.dist.world_size
        return result, peak, tracked

    def run_step(self, batch: Batch) -> StepOutcome:
        """Run the step on ``batch`` (on the model's device); after running out of memory,
        re-plan and run it again (see :mod:`memfit.trainer.oom`). ``step_count`` is not advanced.
        """
        snapshot = StepSnapshot.take(unwrap(self.model), self.optimizer)
        attempt = 0
        while True:
            synchronize(self.device)
            start = time.perf_counter()
            error = None
            try:
                result, peak, tracked = self._run_global(batch)
            except Exception as exc:
                if not is_out_of_memory(exc) or isinstance(exc, OutOfMemory):
                    raise
                error = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            # Out of the except clause, the error's traceback (and the activations its frames
            # hold) is gone before re-planning needs the memory.
            if error is None:
                synchronize(self.device)
                return StepOutcome(result, peak, tracked, time.perf_counter() - start)
            self._recover_from_oom(batch, snapshot, error, attempt)
            attempt += 1

    def _recover_from_oom(self, batch: Batch, snapshot: StepSnapshot, error: str, attempt: int) -> None:
        """Put the step back and re-plan (see :mod:`memfit.trainer.oom`), or raise OutOfMemory."""
        where = f"step {self.step_count + 1} ran out of memory ({error})"
        changed = snapshot.untouched(self.optimizer)
        if changed is not None:
            raise OutOfMemory(
                f"{where} in its optimizer step and {changed}, so it cannot be run again; resume from the "
                "last saved training state with a smaller memory budget."
            )
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        why, new = refusal(self.oom, self.dist.active, attempt), None
        if why is None:
            try:
                # See Note [re-planning from the profiles alone] in memfit.trainer.oom
                new, peak, budget = replan(
                    unwrap(self.model), batch, self.loss_fn, self.optimizer, self.precision.mode, self.plan,
                    self.micro_batches, self.memory.peak_bytes if self.memory else None, self.oom,
                )  # fmt: skip
            except InfeasibleBudget as exc:
                why = f"no plan fits less memory ({str(exc).rstrip('.')})"
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                why = "profiling it for a new plan ran out of memory too"
        snapshot.restore()
        if new is None:
            saved = self._write_last_good() if self._write_last_good is not None else None
            kept = (
                f"the training state from before the step is in {saved}: resume from it"
                if saved
                else ("nothing was saved (no save_last_good was given): save the model from here")
            )
            raise OutOfMemory(f"{where} and {why}; {kept} with a smaller memory budget.", saved)
        before = describe_plan(self.plan, self.micro_batches)
        self.use_plan(new)
        event = ReplanEvent(self.step_count + 1, error, peak, budget, before, describe_plan(new), new)
        self.replans.append(event)
        logging.getLogger("memfit.oom").warning("%s", event.message)

    def use_plan(self, plan: Plan) -> None:
        """Switch to ``plan`` between steps: apply its checkpointing and micro-batches.

        Raises:
            ConfigError: the plan's precision is not the Trainer's.
        """
        if plan.precision != self.precision.mode:
            raise ConfigError(
                f"the plan's precision {plan.precision!r} is not this Trainer's {self.precision.mode!r}."
            )
        _, self.optimizer = prepare(self.model, self.optimizer, plan, precision=self.precision)
        self.plan, self._running, self.micro_batches, self.memory = plan, plan, plan.micro_batches, None

    def evaluate_with(self, eval_fn: Callable[[nn.Module], float]) -> float:
        """``eval_fn(model)`` in eval mode, without gradients, under autocast."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self.precision.autocast():
                return float(eval_fn(self.model))
        finally:
            self.model.train(was_training)

    def evaluate(self, batches: Iterable[Batch]) -> float:
        """Mean loss over ``batches`` in eval mode, without gradients, under autocast."""

        def _mean_loss(model: nn.Module) -> float:
            losses = [float(self.loss_fn(model, to_device(b, self.device))) for b in batches]
            if not losses:
                raise ConfigError("evaluate() got no batches; give at least one validation batch.")
            return sum(losses) / len(losses)

        return self.evaluate_with(_mean_loss)
