"""The Trainer: runs training steps with a precision, a plan, progress, metrics and resume.

It composes the pieces and decides nothing: every step is :func:`memfit.step.training_step`
(autocast, loss scaling, gradient accumulation, clipping after unscaling, zero_grad with
``set_to_none``), memory comes from :class:`memfit.measuring.memory.MemoryWatch`, and
training state goes through :mod:`memfit.train.state`.

Every step runs through a :class:`memfit.check.guards.Guard` (on by default, cheap): fp16
loss-scaler warnings, a stop with the attribution and the last good state on disk when an
fp32/bf16 loss is not finite, and the optional precision fallback.

Trade-off: on a CPU, tracking a step's memory with MemTracker slows that step down, so
the Trainer tracks the first steady-state step (optimizer state already created) and then
every ``memory_every`` steps; on a GPU the allocator's peak is read on every step for free.

Example:
    >>> import torch
    >>> from memfit.train.gpt import GPT, GPTConfig, gpt_loss
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

import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.check.guards import Guard, GuardConfig
from memfit.checkpointing import checkpointed_blocks, refuse_double_checkpointing
from memfit.errors import ConfigError
from memfit.measuring.tracker import MemoryWatch
from memfit.precision import Precision, as_precision
from memfit.records import MemoryReport, Plan, StepMetrics
from memfit.step import Batch, LossFn, StepResult
from memfit.train.callbacks import Callback
from memfit.train.distributed import DistContext, global_mean, local_batch, unwrap
from memfit.train.sharded_state import load_sharded, save_sharded, sharded
from memfit.train.state import load_state, restore_trainer, save_state, trainer_state
from memfit.vocab import normalize_mode

__all__ = ["Trainer"]


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _to_device(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(_to_device(t, device) for t in batch)
    return batch


def _plan_mode(mode: str) -> str | None:
    return None if normalize_mode(mode) == "none" else mode


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
        callbacks: :class:`Callback` objects, called in order.
        progress: show a progress bar in :meth:`fit`; None: only when stderr is a TTY.
        memory_every: also track memory every this many steps (0: only the first
            steady-state step; a GPU reports its allocator peak on every step anyway).
        track_memory: False turns MemTracker off entirely (a GPU still reports its
            allocator peak on every step).
        dist: under ``torchrun``, this process's place in the run
            (:func:`memfit.train.distributed.init_distributed`); ``model`` is then the DDP or
            FSDP2-wrapped model, each step takes this rank's slice of the global batch and
            reports the loss averaged over all ranks.
        guard: the overflow guard's settings (default :class:`memfit.GuardConfig`: on,
            ``on_overflow="stop"``); ``GuardConfig(on_overflow="fallback")`` switches
            precision instead of stopping where it can.
        last_good_path: where the guard writes the last good training state before it
            stops (default: next to a :class:`SaveState` callback's file as
            ``last-good.pt``, else ``memfit-last-good.pt`` in the working directory).

    Raises:
        ConfigError: the arguments contradict the plan, or ``micro_batches < 1``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        precision: str | Precision | None = None,
        plan: Plan | None = None,
        *,
        micro_batches: int | None = None,
        clip_norm: float | None = None,
        scheduler: Any | None = None,
        callbacks: Sequence[Callback] = (),
        progress: bool | None = None,
        memory_every: int = 0,
        track_memory: bool = True,
        dist: DistContext | None = None,
        guard: GuardConfig | None = None,
        last_good_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.dist = dist or DistContext()
        self.model = model
        if checkpointed_blocks(unwrap(model)):
            refuse_double_checkpointing(unwrap(model))
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.device = _model_device(model)
        if plan is not None:
            _check_plan(model, plan, precision, micro_batches)
            precision = precision if precision is not None else plan.precision
            micro_batches = micro_batches if micro_batches is not None else plan.micro_batches
        self.plan = plan
        self.precision = as_precision(precision if precision is not None else "auto", device=self.device)
        if self.precision.fp32_modules:
            self.precision.attach(model)
        self.micro_batches = 1 if micro_batches is None else int(micro_batches)
        if self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be at least 1, got {micro_batches!r}.")
        if clip_norm is not None and not clip_norm > 0:
            raise ConfigError(f"clip_norm must be positive (or None for no clipping), got {clip_norm!r}.")
        self.clip_norm = clip_norm
        self.scheduler = scheduler
        self.callbacks: list[Callback] = list(callbacks)
        self.progress = progress
        self.memory_every = memory_every
        self.track_memory = track_memory
        self.step_count = 0
        self.history: list[StepMetrics] = []
        self.memory: MemoryReport | None = None
        """The breakdown of the last tracked steady-state step."""
        self.stop_reason: str | None = None
        self.fit_completed = True
        """False while the last :meth:`fit` is ended by an exception (e.g. Ctrl-C)."""
        self.guard = Guard(guard or GuardConfig(), save_state=self._save_last_good)
        """The overflow guard; ``trainer.guard.events`` lists what it saw and did."""
        self.last_good_path = Path(last_good_path) if last_good_path is not None else None
        self._data: Any | None = None

    # -- one step ---------------------------------------------------------------------

    def _track_this_step(self) -> bool:
        # NOTE: steady state: optimizer state exists (Adam's moments are created lazily by the
        # first step) or a step was taken (SGD without momentum has no state at all).
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
        )
        return result

    def _save_last_good(self) -> Path:
        """Write the state before the failing step (weights are not yet updated by it)."""
        for callback in self.callbacks:
            saver = getattr(callback, "save_last_good", None)
            if callable(saver):
                return Path(saver(self))
        path = self.last_good_path or Path("memfit-last-good.pt")
        self.save(path, data=self._data)
        return path

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

    def step(self, batch: Batch, eval_fn: Callable[[nn.Module], float] | None = None) -> StepMetrics:
        """Run one optimizer step on ``batch`` and return what it did.

        Args:
            batch: a tensor or tuple of tensors (moved to the model's device).
            eval_fn: if given, called after the step as ``eval_fn(model)`` (in eval
                mode, without gradients, under autocast); its value is ``val_loss``.
        """
        self.model.train()
        batch = _to_device(batch, self.device)  # NOTE: the global batch; _run_global slices it
        lr = float(self.optimizer.param_groups[0].get("lr", 0.0))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        result, peak, tracked = self._run_global(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        if self.scheduler is not None:
            self.scheduler.step()
        self.step_count += 1
        metrics = StepMetrics(
            step=self.step_count,
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
            peak_bytes=peak,
            tracked=tracked,
        )
        if eval_fn is not None:
            metrics.val_loss = self._evaluate_with(eval_fn)
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

    # -- evaluation -------------------------------------------------------------------

    def _evaluate_with(self, eval_fn: Callable[[nn.Module], float]) -> float:
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
            losses = [float(self.loss_fn(model, _to_device(b, self.device))) for b in batches]
            if not losses:
                raise ConfigError("evaluate() got no batches; give at least one validation batch.")
            return sum(losses) / len(losses)

        return self._evaluate_with(_mean_loss)

    # -- many steps -------------------------------------------------------------------

    def progress_enabled(self) -> bool:
        """Whether :meth:`fit` shows a progress bar (``progress``, else: stderr is a TTY)."""
        if self.progress is not None:
            return self.progress
        return sys.stderr.isatty() and not os.environ.get("MEMFIT_QUIET")

    def fit(
        self,
        batches: Iterable[Batch],
        steps: int,
        eval_fn: Callable[[nn.Module], float] | None = None,
        eval_every: int | None = None,
    ) -> list[StepMetrics]:
        """Run up to ``steps`` more steps, taking one batch per step from ``batches``.

        Args:
            batches: an iterable of batches (a :class:`memfit.train.data.BatchSampler`
                is one); training stops early if it runs out.
            steps: how many steps to run now.
            eval_fn: ``eval_fn(model) -> float``, called every ``eval_every`` steps
                (counted by the total step number) and after the last one.
            eval_every: evaluation interval; None or 0: only after the last step.

        Returns:
            The metrics of the steps run now.
        """
        from tqdm import tqdm  # NOTE: imported here so importing memfit stays light

        if steps < 0:
            raise ConfigError(f"steps must be 0 or more, got {steps}.")
        self.stop_reason = None
        done: list[StepMetrics] = []
        self._data = batches if callable(getattr(batches, "state_dict", None)) else None
        iterator = iter(batches)
        for callback in self.callbacks:
            callback.on_fit_start(self)
        completed = False
        bar = tqdm(total=steps, disable=not self.progress_enabled(), unit="step", dynamic_ncols=True)
        try:
            for i in range(steps):
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
                due = bool(eval_every) and (self.step_count + 1) % int(eval_every or 1) == 0
                metrics = self.step(batch, eval_fn if (due or i == steps - 1) else None)
                done.append(metrics)
                bar.update(1)
                bar.set_postfix_str(_postfix(metrics, self.precision.scaler.is_enabled()), refresh=False)
                if self.stop_reason is not None:
                    break
            completed = True
        finally:
            bar.close()
            self.fit_completed = completed
            for callback in self.callbacks:
                callback.on_fit_end(self)
        return done

    # -- summaries --------------------------------------------------------------------

    @property
    def peak_bytes(self) -> int | None:
        """The largest peak of any tracked step so far (None before one was tracked)."""
        peaks = [m.peak_bytes for m in self.history if m.peak_bytes is not None]
        return max(peaks) if peaks else None

    # -- training state ---------------------------------------------------------------

    def state_dict(self, data: Any | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Everything needed to continue exactly here: model, optimizer, scaler, scheduler,
        RNG states, ``data.state_dict()`` (a sampler's position) and the step count."""
        return trainer_state(self, data, extra)

    def load_state_dict(self, state: dict[str, Any], data: Any | None = None) -> dict[str, Any]:
        """Restore :meth:`state_dict` (and ``data``'s position); returns its ``extra`` dict."""
        return restore_trainer(self, state, data)

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
        """Restore the state saved by :meth:`save` (checksum verified, ``weights_only``)."""
        state = load_state(path)
        if state.get("sharded"):
            load_sharded(self.model, self.optimizer, path)
        return self.load_state_dict(state, data)


def _postfix(m: StepMetrics, scaled: bool) -> str:
    text = f"loss {m.loss:.4f}  {m.tokens_per_s:,.0f} tok/s"
    if scaled:
        text += f"  scale {m.scale:g}" + ("  skipped" if m.skipped else "")
    return text


def _check_plan(
    model: nn.Module, plan: Plan, precision: str | Precision | None, micro_batches: int | None
) -> None:
    asked = precision.mode if isinstance(precision, Precision) else precision
    if asked is not None and asked != plan.precision:
        raise ConfigError(
            f"precision {asked!r} contradicts the plan's {plan.precision!r}; pass one of them, not both."
        )
    if micro_batches is not None and micro_batches != plan.micro_batches:
        raise ConfigError(
            f"micro_batches={micro_batches} contradicts the plan's {plan.micro_batches}; pass one of them."
        )
    actual = checkpointed_blocks(unwrap(model))
    for name, mode in plan.blocks.items():
        if actual.get(name) != _plan_mode(mode):
            raise ConfigError(
                f"block {name!r} is checkpointed as {actual.get(name) or 'none'!r} but the plan says "
                f"{mode!r}; call memfit.apply(model, plan) before creating the Trainer."
            )
