"""Guards for long runs: loss-scaler warnings, stop on a non-finite loss, optional fallback.

The guard costs almost nothing per step: one finiteness test of the loss (already read by
the step) and a look at the scaler's record. Hooks are installed only after something went
wrong, to replay the failed micro-batch and name the module that produced the first
non-finite value (:func:`memfit.check.attribution.attribute`).

- fp16: a warning when the scaler skipped more than ``max_skip_fraction`` of the last
  ``window`` steps (gradients overflowing), or when the scale fell below ``min_scale``.
- A non-finite loss means the forward pass itself overflowed, which no loss scale can
  repair (in fp16 every later step would be skipped, training nothing): in every precision
  the step is stopped before backward, the last good state (the weights before this step)
  is saved and :class:`~memfit.errors.NonFiniteLoss` names the module, phase and dtype.
- ``on_overflow="fallback"``: fp16 switches to bf16 where the device runs bf16, otherwise
  (or with ``fallback_to="fp32_modules"``) the attributed module is kept in fp32; bf16 keeps
  the attributed module in fp32 once. Every change is logged with its step.

Trade-off: checking the loss before backward forces one host-device sync per micro-batch
that would otherwise come a little later; the fallback changes numerics mid-run, which
the log records so that a result can be traced.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> guard = Guard()
    >>> result, precision = guard.step(model, torch.ones(2, 4), lambda m, b: m(b).sum(), opt,
    ...                                Precision("fp32", device="cpu"), step=1)
    >>> guard.events
    []
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from memfit.check.attribution import attribute
from memfit.errors import ConfigError, NonFiniteLoss
from memfit.precision import Precision
from memfit.records import NonFinite
from memfit.step import Batch, LossFn, StepResult, training_step
from memfit.vocab import GUARD_ACTIONS, MIXED_PRECISIONS, GuardAction

__all__ = ["Guard", "GuardConfig", "GuardEvent"]

_FALLBACKS = ("auto", "bf16", "fp32_modules")
log = logging.getLogger("memfit.guard")


@dataclass(kw_only=True)
class GuardConfig:
    """How the Trainer guards a run (on by default)."""

    enabled: bool = True
    """Turn all guards off (then a non-finite loss trains on, as plain PyTorch would)."""
    window: int = 20
    """Recent steps the skip fraction is taken over."""
    max_skip_fraction: float = 0.25
    """Warn (or fall back) when the fp16 scaler skipped more than this fraction of the window."""
    min_scale: float = 1.0
    """Warn (or fall back) when the fp16 loss scale falls below this."""
    on_overflow: GuardAction = "stop"
    """``"stop"``: warn on fp16 trouble, stop on non-finite fp32/bf16 loss; ``"fallback"``: switch."""
    fallback_to: str = "auto"
    """fp16 fallback: ``"auto"``/``"bf16"`` (bf16 where the device runs it), ``"fp32_modules"``."""

    def __post_init__(self) -> None:
        if self.on_overflow not in GUARD_ACTIONS:
            raise ConfigError(f"on_overflow {self.on_overflow!r} is not one of {', '.join(GUARD_ACTIONS)}.")
        if self.fallback_to not in _FALLBACKS:
            raise ConfigError(f"fallback_to {self.fallback_to!r} is not one of {', '.join(_FALLBACKS)}.")
        if self.window < 1:
            raise ConfigError(f"the guard window must be at least 1 step, got {self.window}.")
        if not 0 <= self.max_skip_fraction <= 1:
            raise ConfigError(f"max_skip_fraction must be between 0 and 1, got {self.max_skip_fraction}.")


@dataclass
class GuardEvent:
    """Something the guard saw or did, at a step."""

    step: int
    kind: str
    """``"warning"``, ``"fallback"`` or ``"stop"``."""
    message: str
    attribution: NonFinite | None = None


class _LossNotFinite(Exception):
    def __init__(self, batch: Batch, rng: torch.Tensor, cuda_rng: torch.Tensor | None, value: float) -> None:
        super().__init__("non-finite loss")
        self.batch, self.rng, self.cuda_rng, self.value = batch, rng, cuda_rng, value


def _checked(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` that raises before backward when the loss is not finite."""

    def guarded(model: nn.Module, batch: Batch) -> torch.Tensor:
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        loss = loss_fn(model, batch)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise _LossNotFinite(batch, rng, cuda_rng, value)
        return loss

    return guarded


def _where(nf: NonFinite | None) -> str:
    if nf is None:
        return "the replay was finite, so no module could be named (the cause may be nondeterministic)"
    return f"first non-finite value ({nf.value}) in the {nf.phase} pass of module {nf.module!r} ({nf.dtype})"


@dataclass
class Guard:
    """Watches every step of a run; see the module docstring for what it does.

    Args:
        config: the settings (default :class:`GuardConfig`).
        save_state: called with a path-less request to write the last good training state
            before stopping; returns where it was written (the Trainer passes its saver).
    """

    config: GuardConfig = field(default_factory=GuardConfig)
    save_state: Callable[[], Path | None] | None = None
    events: list[GuardEvent] = field(default_factory=list)
    _recent: deque[bool] = field(default_factory=deque)
    _warned: set[str] = field(default_factory=set)
    _fp32_kept: set[str] = field(default_factory=set)

    def _event(self, step: int, kind: str, message: str, nf: NonFinite | None = None) -> None:
        self.events.append(GuardEvent(step, kind, message, nf))
        # A stop is also raised as NonFiniteLoss, which the caller reports: logged at INFO so
        # that it is not printed twice.
        (log.info if kind == "stop" else log.warning)("step %d: %s", step, message)

    def step(
        self,
        model: nn.Module,
        batch: Batch,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer | None,
        precision: Precision,
        step: int,
        micro_batches: int = 1,
        clip_norm: float | None = None,
        run: Callable[[LossFn, Precision], StepResult] | None = None,
    ) -> tuple[StepResult, Precision]:
        """Run one guarded training step; returns its result and the precision to go on with.

        ``run(loss_fn, precision)`` runs the step itself (the Trainer passes
        :func:`memfit.loop.planned_step`); default :func:`memfit.step.training_step` with
        ``micro_batches`` and ``clip_norm``.

        Raises:
            NonFiniteLoss: an fp32 or bf16 loss was not finite and nothing could fall back.
        """
        if run is None:

            def run(fn: LossFn, p: Precision) -> StepResult:
                return training_step(model, batch, fn, optimizer, p, micro_batches, clip_norm)

        if not self.config.enabled:
            return run(loss_fn, precision), precision
        for _ in range(3):  # at most two fallbacks for one step
            try:
                result = run(_checked(loss_fn), precision)
            except _LossNotFinite as bad:
                nf = attribute(model, bad.batch, loss_fn, precision, step, bad.rng, bad.cuda_rng)
                precision = self._recover(model, precision, step, nf, f"loss is {bad.value}", forward=True)
                continue
            return result, self._observe(model, batch, loss_fn, precision, step, result)
        raise NonFiniteLoss(f"step {step} stayed non-finite after falling back; stopping.", None, None)

    def _observe(
        self, model: nn.Module, batch: Batch, loss_fn: LossFn, precision: Precision, step: int, r: StepResult
    ) -> Precision:
        if not precision.scaler.is_enabled():
            return precision
        self._recent.append(r.skipped)
        while len(self._recent) > self.config.window:
            self._recent.popleft()
        skipped = sum(self._recent)
        scale = float(precision.scaler.get_scale())
        problem, kind = None, ""
        if len(self._recent) == self.config.window and skipped > self.config.max_skip_fraction * len(
            self._recent
        ):
            problem, kind = (
                f"the fp16 loss scaler skipped {skipped} of the last {len(self._recent)} steps",
                "skips",
            )
        elif scale < self.config.min_scale:
            problem, kind = (
                f"the fp16 loss scale fell to {scale:g} (below {self.config.min_scale:g})",
                "scale",
            )
        if problem is None:
            self._warned.clear()
            return precision
        if self.config.on_overflow == "fallback":
            nf = attribute(model, batch, loss_fn, precision, step)
            return self._recover(model, precision, step, nf, problem)
        if kind not in self._warned:  # once per kind until it recovers
            self._warned.add(kind)
            self._event(step, "warning", f"{problem}; gradients overflow fp16 (try bf16 or fp32_modules)")
        return precision

    def _recover(
        self,
        model: nn.Module,
        precision: Precision,
        step: int,
        nf: NonFinite | None,
        problem: str,
        forward: bool = False,
    ) -> Precision:
        """Fall back to a safer precision, or save the last good state and stop.

        ``forward``: the loss itself was not finite (no loss scale can repair that), as
        opposed to the fp16 scaler skipping steps because gradients overflow.
        """
        where = _where(nf)
        if self.config.on_overflow == "fallback":
            new = self._fallback(model, precision, nf)
            if new is not None:
                change = f"precision {precision.mode} -> {new.mode}"
                if new.mode == precision.mode:
                    change = f"module {new.fp32_modules[-1]!r} now kept in fp32 under {new.mode}"
                self._event(step, "fallback", f"{problem}; {where}; {change} from step {step} on", nf)
                self._recent.clear()
                return new
        if precision.scaler.is_enabled() and not forward:  # gradients overflow: the scaler skips
            self._event(
                step, "warning", f"{problem}; {where}; no fallback left, the scaler skips the step", nf
            )
            return precision
        saved = self.save_state() if self.save_state is not None else None
        kept = f"; the last good state (before step {step}) is in {saved}" if saved else ""
        message = f"{precision.mode} training stopped at step {step}: {problem}; {where}{kept}."
        self._event(step, "stop", message, nf)
        raise NonFiniteLoss(message, nf, saved)

    def _fallback(self, model: nn.Module, precision: Precision, nf: NonFinite | None) -> Precision | None:
        named = nf is not None and nf.module not in ("(model)", "<loss>")
        if (
            precision.kind.loss_scaled  # fp16: fall back to bf16, which needs no loss scaling
            and self.config.fallback_to != "fp32_modules"
            and precision.facts.bf16_runs
        ):
            return Precision("bf16", device=precision.device, fp32_modules=precision.fp32_modules)
        if (
            precision.mode in MIXED_PRECISIONS
            and named
            and nf is not None
            and nf.module not in self._fp32_kept
        ):
            self._fp32_kept.add(nf.module)
            kept = (*precision.fp32_modules, nf.module)
            new = Precision(precision.mode, device=precision.device, fp32_modules=kept)  # a fresh scaler
            Precision.detach(model)
            new.attach(model)
            return new
        return None
