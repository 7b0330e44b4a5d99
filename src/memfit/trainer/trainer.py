"""The Trainer: runs training steps with a precision, a plan, progress, metrics and resume.

It composes the pieces and decides nothing: every step is :func:`memfit.step.training_step`
(autocast, loss scaling, gradient accumulation, clipping after unscaling, zero_grad with
``set_to_none``), memory comes from :class:`memfit.measuring.tracker.MemoryWatch`, and
training state goes through :mod:`memfit.trainer.state`.

One step (guard, memory tracking, re-planning after running out of memory) is the
:class:`memfit.trainer.stepper.Stepper`'s that the Trainer owns (``trainer.stepper``); the
Trainer adds the loop, callbacks and its state, and reads the step's facts (model, optimizer,
precision, plan, memory) from its stepper.

Trade-off: the state dict holds whole tensors (the model's and the optimizer's), so saving
needs their size in host memory once; in return a saved run resumes bit for bit.

Example:
    >>> import torch
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> torch.manual_seed(0) and None
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> trainer = Trainer(model, torch.optim.AdamW(model.parameters()), gpt_loss, "fp32",
    ...                   progress=False)
    >>> x = torch.randint(0, 256, (4, 16))
    >>> history = trainer.fit([(x, x)] * 3, steps=3)
    >>> [m.step for m in history], history[1].peak_bytes > 0
    ([1, 2, 3], True)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from memfit import progress
from memfit.check.guards import Guard, GuardConfig
from memfit.checkpointing.compile import is_compiled
from memfit.devices import unwrap
from memfit.errors import ConfigError, StateError
from memfit.precision import Precision
from memfit.records import MemoryReport, Plan, StepMetrics
from memfit.step import Batch, LossFn
from memfit.trainer.distributed import DistContext
from memfit.trainer.oom import OomConfig, ReplanEvent
from memfit.trainer.sharded_state import load_sharded, save_sharded, sharded
from memfit.trainer.signals import agreed_stop
from memfit.trainer.state import capture_rng, load_state, restore_rng, save_state
from memfit.trainer.stepper import StepOutcome, Stepper, to_device
from memfit.vocab import PrecisionChoice

__all__ = ["Trainer", "TrainerCallback"]

#: The ``"format"`` entry of a Trainer's state dict.
STATE_FORMAT = "memfit-training-state"


# The Trainer calls its callbacks through a Protocol, so that it need not import
# memfit.trainer.callbacks (whose callbacks refer to the Trainer): the import graph stays a tree.


class TrainerCallback(Protocol):
    """The hooks the Trainer calls; :class:`memfit.trainer.callbacks.Callback` implements them all."""

    def on_fit_start(self, trainer: Any) -> None:
        """When :meth:`Trainer.fit` starts."""

    def on_step_end(self, trainer: Any, metrics: StepMetrics) -> None:
        """After every step."""

    def on_fit_end(self, trainer: Any) -> None:
        """When :meth:`Trainer.fit` ends."""

    def save_last_good(self, trainer: Any) -> Path | None:
        """Write the state before a step that cannot go on; return where, or None."""


def progress_postfix(m: StepMetrics, scaled: bool) -> str:
    """The progress bar's text after a step: loss, speed, and the fp16 loss scale."""
    text = f"loss {m.loss:.4f}  {m.tokens_per_s:,.0f} tok/s"
    if scaled:
        text += f"  scale {m.scale:g}" + ("  skipped" if m.skipped else "")
    return text


class Trainer:
    """Train a model step by step in the chosen precision, reporting what each step cost.

    Args:
        model: the model, on its device, already checkpointed as wanted (or by
            ``memfit.apply(model, plan)``).
        optimizer: its optimizer.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        precision: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"auto"`` or a Precision; default
            the plan's precision, else ``"auto"``.
        plan: a :class:`memfit.Plan`; the Trainer takes its precision and micro-batches
            and checks that the model is checkpointed as the plan says.
        micro_batches: split each batch into this many micro-batches with gradient
            accumulation (default: the plan's, else 1).
        clip_norm: clip the gradient norm to this (after unscaling); None turns it off.
        scheduler: a learning-rate scheduler stepped after every optimizer step.
        callbacks: :class:`memfit.trainer.callbacks.Callback` objects (anything with its hooks),
            called in order.
        progress: show a progress bar in :meth:`fit`; None: only when stderr is a TTY.
        memory_every: also track memory every this many steps (0: only the first
            steady-state step; a GPU reports its allocator peak on every step anyway).
        track_memory: False turns MemTracker off entirely (a GPU still reports its
            allocator peak on every step).
        dist: under ``torchrun``, this process's place in the run
            (:func:`memfit.trainer.distributed.init_distributed`); ``model`` is then the DDP or
            FSDP2-wrapped model, each step takes this rank's slice of the global batch and
            reports the loss averaged over all ranks.
        guard: the overflow guard's settings (default :class:`memfit.check.guards.GuardConfig`: on,
            ``on_overflow="stop"``); ``GuardConfig(on_overflow="fallback")`` switches
            precision instead of stopping where it can.
        last_good_path: where the guard writes the last good training state before it
            stops (default: next to a :class:`SaveState` callback's file as
            ``last-good.pt``, else ``memfit-last-good.pt`` in the working directory).
        oom: what to do when a step runs out of memory (default :class:`OomConfig`:
            re-plan with less memory and run the step again, see :mod:`memfit.trainer.oom`).
        compile: compile the model in place (``model.compile()``) once the plan is applied;
            on CPU memory is then not tracked (``memory_note`` says so).

    Raises:
        ConfigError: the arguments contradict the plan, or ``micro_batches < 1``.
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
        scheduler: Any | None = None,
        callbacks: Sequence[TrainerCallback] = (),
        progress: bool | None = None,
        memory_every: int = 0,
        track_memory: bool = True,
        dist: DistContext | None = None,
        guard: GuardConfig | None = None,
        last_good_path: str | os.PathLike[str] | None = None,
        oom: OomConfig | None = None,
        compile: bool = False,
    ) -> None:
        self.stepper = Stepper(
            model, optimizer, loss_fn, precision, plan,
            micro_batches=micro_batches, clip_norm=clip_norm, memory_every=memory_every,
            track_memory=track_memory, dist=dist, guard=guard, oom=oom, save_last_good=self._save_last_good,
            compile=compile,
        )  # fmt: skip
        """The one-step runner: guard, memory tracking, re-plan after running out of memory."""
        if scheduler is not None and getattr(scheduler, "optimizer", None) is optimizer:
            scheduler.optimizer = self.optimizer  # a plan's levers may train a new optimizer
        self.scheduler = scheduler
        self.callbacks: list[TrainerCallback] = list(callbacks)
        self.progress = progress
        self.history: list[StepMetrics] = []
        self.stop_reason: str | None = None
        self.fit_completed = True
        """False while the last :meth:`fit` is ended by an exception (e.g. Ctrl-C)."""
        self.last_good_path = Path(last_good_path) if last_good_path is not None else None
        self._data: Any | None = None

    # -- the step's facts, owned by the stepper ----------------------------------------

    @property
    def model(self) -> nn.Module:
        """The model being trained (DDP or FSDP2-wrapped under torchrun)."""
        return self.stepper.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer in use (a plan's levers may have replaced the one given)."""
        return self.stepper.optimizer

    @property
    def loss_fn(self) -> LossFn:
        """``loss_fn(model, batch) -> scalar loss``."""
        return self.stepper.loss_fn

    @loss_fn.setter
    def loss_fn(self, value: LossFn) -> None:
        self.stepper.loss_fn = value

    @property
    def precision(self) -> Precision:
        """The precision steps run in (the guard may fall back to a safer one)."""
        return self.stepper.precision

    @property
    def plan(self) -> Plan | None:
        """The plan being trained with (a re-plan after running out of memory replaces it)."""
        return self.stepper.plan

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step (gradient accumulation)."""
        return self.stepper.micro_batches

    @property
    def device(self) -> torch.device:
        """The model's device."""
        return self.stepper.device

    @property
    def dist(self) -> DistContext:
        """This process's place in a torchrun run (one process: ``DistContext()``)."""
        return self.stepper.dist

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (a resumed run counts from the saved step)."""
        return self.stepper.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.stepper.step_count = value

    @property
    def memory(self) -> MemoryReport | None:
        """The breakdown of the last tracked steady-state step."""
        return self.stepper.memory

    @property
    def memory_note(self) -> str | None:
        """Why memory is not tracked, when that is not the caller's choice."""
        return self.stepper.memory_note

    @property
    def guard(self) -> Guard:
        """The overflow guard; ``.guard.events`` lists what it saw and did."""
        return self.stepper.guard

    @property
    def replans(self) -> list[ReplanEvent]:
        """The re-plans after out-of-memory steps, in order."""
        return self.stepper.replans

    def use_plan(self, plan: Plan) -> None:
        """Switch to ``plan`` between steps (:meth:`memfit.trainer.stepper.Stepper.use_plan`)."""
        self.stepper.use_plan(plan)

    def evaluate(self, batches: Iterable[Batch]) -> float:
        """Mean loss over ``batches`` in eval mode, without gradients, under autocast."""
        return self.stepper.evaluate(batches)

    # -- one step ---------------------------------------------------------------------

    def _save_last_good(self) -> Path:
        """Write the state before the failing step (weights are not yet updated by it)."""
        for callback in self.callbacks:
            saved = callback.save_last_good(self)
            if saved is not None:
                return Path(saved)
        path = self.last_good_path or Path("memfit-last-good.pt")
        self.save(path, data=self._data)
        return path

    def step(self, batch: Batch, eval_fn: Callable[[nn.Module], float] | None = None) -> StepMetrics:
        """Run one optimizer step on ``batch`` and return what it did.

        Args:
            batch: a tensor or tuple of tensors (moved to the model's device).
            eval_fn: if given, called after the step as ``eval_fn(model)`` (in eval
                mode, without gradients, under autocast); its value is ``val_loss``.
        """
        self.model.train()
        batch = to_device(batch, self.device)  # the global batch; the stepper slices it per rank
        lr = float(self.optimizer.param_groups[0].get("lr", 0.0))
        outcome = self.stepper.run_step(batch)
        if self.scheduler is not None:
            self.scheduler.step()
        self.step_count += 1
        metrics = _metrics(self.step_count, lr, outcome)
        if eval_fn is not None:
            metrics.val_loss = self.stepper.evaluate_with(eval_fn)
        self.history.append(metrics)
        self._after_step(metrics)
        return metrics

    def _after_step(self, metrics: StepMetrics) -> None:
        """The hook point after each step: calls every callback's ``on_step_end``."""
        for callback in self.callbacks:
            callback.on_step_end(self, metrics)

    def stop(self, reason: str) -> None:
        """Ask :meth:`fit` to stop after the current step; ``reason`` is kept in ``stop_reason``."""
        self.stop_reason = reason

    # -- many steps -------------------------------------------------------------------

    def progress_enabled(self) -> bool:
        """Whether :meth:`fit` shows a progress bar (``progress``, else: stderr is a TTY)."""
        if self.progress is not None:
            return self.progress
        return progress.style() == "bar"

    def fit(
        self,
        batches: Iterable[Batch],
        steps: int,
        eval_fn: Callable[[nn.Module], float] | None = None,
        eval_every: int | None = None,
    ) -> list[StepMetrics]:
        """Run up to ``steps`` more steps, taking one batch per step from ``batches``.

        Args:
            batches: an iterable of batches (a :class:`memfit.app.data.BatchSampler`
                is one); training stops early if it runs out.
            steps: how many steps to run now.
            eval_fn: ``eval_fn(model) -> float``, called every ``eval_every`` steps
                (counted by the total step number) and after the last one.
            eval_every: evaluation interval; None or 0: only after the last step.

        Returns:
            The metrics of the steps run now.
        """
        from tqdm import tqdm  # imported here so that importing memfit stays light

        if steps < 0:
            raise ConfigError(f"steps must be 0 or more, got {steps}.")
        self.stop_reason = None
        done: list[StepMetrics] = []
        self._data = batches if callable(getattr(batches, "state_dict", None)) else None
        iterator = iter(batches)
        for callback in self.callbacks:
            callback.on_fit_start(self)
        completed = False
        # the bar counts the model's steps (the demo's 250, a resumed run's 20 to 40), not this call's
        start, end = self.step_count, self.step_count + steps
        shown = self.progress_enabled()
        bar = tqdm(total=end, initial=start, disable=not shown, unit="step", dynamic_ncols=True)
        # In a log (no terminal), the same progress as rate-limited plain lines on stderr.
        in_lines = self.progress is not False and not self.progress_enabled() and progress.style() == "lines"
        stack = contextlib.ExitStack()
        phase = stack.enter_context(progress.phase("training", end, start)) if in_lines else None
        try:
            for i in range(steps):
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
                due = bool(eval_every) and (self.step_count + 1) % int(eval_every or 1) == 0
                metrics = self.step(batch, eval_fn if (due or i == steps - 1) else None)
                done.append(metrics)
                postfix = progress_postfix(metrics, self.precision.scaler.is_enabled())
                compiled = i == 0 and is_compiled(unwrap(self.model))  # it compiled: not a typical step
                bar.update(1)
                bar.set_postfix_str(postfix, refresh=False)
                if compiled:
                    bar.reset(total=end)  # the time left is estimated from the steps after it
                    bar.update(start + 1)
                if phase is not None:
                    phase.advance(1, postfix, timed=not compiled)
                agreed = agreed_stop(self.stop_reason, self.dist)
                if agreed is not None:
                    self.stop_reason = agreed
                    break
                # a stop asked while the ranks agreed (a signal handled inside the all-reduce)
                # is kept, not overwritten: the next step's agreement stops every rank
            completed = True
        finally:
            bar.close()
            stack.close()
            self.fit_completed = completed
            self._end_fit()
        return done

    def _end_fit(self) -> None:
        """Every callback's ``on_fit_end``, also when one of them fails (the first error is raised)."""
        failed: BaseException | None = None
        for callback in self.callbacks:
            try:
                callback.on_fit_end(self)
            except Exception as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    # -- summaries --------------------------------------------------------------------

    @property
    def peak_bytes(self) -> int | None:
        """The largest peak of any tracked step so far (None before one was tracked)."""
        peaks = [m.peak_bytes for m in self.history if m.peak_bytes is not None]
        return max(peaks) if peaks else None

    # -- training state ---------------------------------------------------------------

    def state_dict(self, data: Any | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Everything needed to continue exactly here: model, optimizer, scaler, scheduler,
        RNG states, ``data.state_dict()`` (a sampler's position), the step count and ``extra``.

        The model's state is that of the model inside a DDP wrapper, so its keys are the
        same with and without DDP."""
        return {
            "format": STATE_FORMAT,
            "version": 1,
            "step": self.step_count,
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "precision": self.precision.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": capture_rng(),
            "data": data.state_dict() if data is not None else None,
            "extra": extra or {},
        }

    def load_state_dict(self, state: dict[str, Any], data: Any | None = None) -> dict[str, Any]:
        """Restore :meth:`state_dict` (and ``data``'s position); returns its ``extra`` dict.

        Raises:
            StateError: the state is not a Trainer's, or its model does not fit this one.
        """
        if state.get("format") != STATE_FORMAT:
            raise StateError("this file is not a memfit Trainer state; write one with Trainer.save().")
        # An FSDP2 state holds no "model" and "optimizer": their shards were loaded with DCP.
        try:
            if "model" in state:
                unwrap(self.model).load_state_dict(state["model"])
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0]
            raise StateError(
                f"the saved model does not fit this model ({first.rstrip('.:')}); resume with the same model."
            ) from None
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.precision.load_state_dict(state["precision"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if data is not None and state.get("data") is not None:
            data.load_state_dict(state["data"])
        restore_rng(state["rng"])
        self.step_count = int(state["step"])
        return dict(state.get("extra") or {})

    def save(
        self, path: str | os.PathLike[str], data: Any | None = None, extra: dict[str, Any] | None = None
    ) -> None:
        """Write the training state atomically to ``path`` (the older file is kept as
        ``*.prev.pt``); ``data`` is the batch sampler whose position to save.

        Under DDP only rank 0 writes (every rank holds the same state); under FSDP2 every
        rank writes its shard of the model and optimizer with ``torch.distributed.checkpoint``
        next to ``path`` and rank 0 writes the rest to ``path``."""
        if sharded(self.model):
            state = self.state_dict(data, extra)
            del state["model"], state["optimizer"]
            save_sharded(self.model, self.optimizer, path, state, self.dist.is_main)
        elif self.dist.is_main:
            save_state(self.state_dict(data, extra), path)

    def load(self, path: str | os.PathLike[str], data: Any | None = None) -> dict[str, Any]:
        """Restore the state saved by :meth:`save` (authenticated, ``weights_only``, shards verified)."""
        state = load_state(path)
        if state.get("sharded"):
            load_sharded(self.model, self.optimizer, path, state.get("shards"))
        return self.load_state_dict(state, data)


def _metrics(step: int, lr: float, outcome: StepOutcome) -> StepMetrics:
    """A step's metrics from what its attempt that succeeded did."""
    result, seconds = outcome.result, outcome.seconds
    return StepMetrics(
        step=step,
        loss=result.loss,
        lr=lr,
        grad_norm=result.grad_norm,
        scale=result.scale,
        skipped=result.skipped,
        samples=result.samples,
        tokens=result.tokens,
        seconds=seconds,
        samples_per_s=result.samples / seconds if seconds > 0 else 0.0,
        tokens_per_s=result.tokens / seconds if seconds > 0 else 0.0,
        peak_bytes=outcome.peak_bytes,
        tracked=outcome.tracked,
    )
