"""Trainer callbacks that write to disk: a metrics log and periodic training-state saves.

Trade-off: the metrics log is flushed after every line so a killed run leaves every
finished step on disk, at the cost of one small write per step.

Example:
    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> from memfit.trainer.trainer import Trainer
    >>> out = Path(tempfile.mkdtemp())
    >>> model = torch.nn.Linear(4, 1)
    >>> log = MetricsLog(out / "metrics.jsonl")
    >>> trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
    ...                   lambda m, b: m(b).pow(2).mean(), "fp32", callbacks=[log], progress=False)
    >>> _ = trainer.fit([torch.randn(8, 4)] * 2, steps=2)
    >>> [r.step for r in read_metrics(out / "metrics.jsonl")]
    [1, 2]
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from memfit.errors import ConfigError, StateError, is_out_of_memory
from memfit.outputs import write_text
from memfit.reading import read_bounded
from memfit.records import StepMetrics

if TYPE_CHECKING:
    from memfit.trainer.trainer import Trainer

__all__ = ["Callback", "MetricsLog", "SaveState", "read_metrics"]


class Callback:
    """Hooks the Trainer calls around training; override the ones you need.

    A callback may call ``trainer.stop(reason)`` to end :meth:`Trainer.fit` after the
    current step (overflow guards, early stopping).
    """

    def on_fit_start(self, trainer: Trainer) -> None:
        """Called when :meth:`Trainer.fit` starts."""

    def on_step_end(self, trainer: Trainer, metrics: StepMetrics) -> None:
        """Called after every step (and its evaluation, if any) with what it did."""

    def on_fit_end(self, trainer: Trainer) -> None:
        """Called when :meth:`Trainer.fit` ends, also when it stops early."""

    def save_last_good(self, trainer: Trainer) -> Path | None:
        """Write the last good training state and return where, or None to leave it to others.

        The Trainer calls this (callbacks in order, the first path wins) before it stops on
        a step that cannot go on: a non-finite loss, or running out of memory with no plan
        that fits. Model, optimizer and step count are then those before the failed step.
        """
        return None


#: The largest metrics log read back (a million steps take about 300 MB).
_MAX_METRICS_BYTES = 2**30


def read_metrics(path: str | os.PathLike[str]) -> list[StepMetrics]:
    """Read a ``metrics.jsonl``; a last line cut short by a crash is skipped.

    Raises:
        StateError: ``path`` is a directory, a FIFO or a device, or cannot be read.
    """
    rows = []
    p = Path(path)
    if not os.path.lexists(p):
        return []
    data = read_bounded(
        p, "the metrics log", _MAX_METRICS_BYTES, error=StateError, hint="move it away and run again."
    )
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            rows.append(StepMetrics.from_dict(json.loads(line)))
        except (json.JSONDecodeError, ValueError, TypeError):
            continue
    return rows


class MetricsLog(Callback):
    """Append one JSON line per step to ``path``.

    Args:
        path: the ``metrics.jsonl`` file.
        keep_until: keep the lines of steps up to this one and drop later ones (a resumed
            run rewrites the steps after its saved state); None starts a new file.
    """

    def __init__(self, path: str | os.PathLike[str], keep_until: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [] if keep_until is None else [m for m in read_metrics(self.path) if m.step <= keep_until]
        try:
            write_text(self.path, "".join(m.to_json(indent=None) + "\n" for m in kept), "the metrics log")
        except ConfigError as exc:
            raise StateError(str(exc)) from None
        self._file: IO[str] | None = None
        self.error: str | None = None
        """Why a line could not be written (the Trainer is then asked to stop), or None."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """Open the file for appending."""
        self._file = self.path.open("a", encoding="utf-8")

    def on_step_end(self, trainer: Trainer, metrics: StepMetrics) -> None:
        """Write and flush the step's line; when that fails, stop training after this step."""
        try:
            if self._file is None:
                self.on_fit_start(trainer)
            assert self._file is not None
            self._file.write(metrics.to_json(indent=None) + "\n")
            self._file.flush()
        except OSError as exc:
            self.error = f"cannot write {str(self.path)!r} ({exc.strerror or exc})"
            trainer.stop(self.error)

    def on_fit_end(self, trainer: Trainer) -> None:
        """Close the file."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                self.error = self.error or f"cannot write {str(self.path)!r} ({exc.strerror or exc})"
            self._file = None


#: What ``torch.save``'s archive writer says when a write fails part-way (a full disk, or
#: memory for its buffers running out): ``[enforce fail at inline_container.cc:...]``.
_WRITE_FAILURES = ("inline_container", "unexpected pos", "PytorchStreamWriter failed")
#: Reasons a second try may cure, once the step's memory is freed.
_ROOM = ("out of memory", "no space", "file too large", "disk quota", *_WRITE_FAILURES)


def _is_write_failure(exc: BaseException) -> bool:
    return any(m in str(exc) for m in _WRITE_FAILURES)


def _lack_of_room(reason: str) -> bool:
    return any(m in reason.lower() for m in (r.lower() for r in _ROOM))


def _free_memory(trainer: Trainer) -> None:
    """Drop what the last step may still hold (gradients, cached blocks) before a second save."""
    trainer.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class SaveState(Callback):
    """Save the training state every ``every`` steps and when :meth:`Trainer.fit` ends.

    Args:
        path: the state file (``state.pt``); the one before it is kept as ``state.prev.pt``.
        every: steps between saves (0: only at the end).
        data: the batch sampler whose position is saved with the state.
        extra: plain data saved alongside (e.g. the run's config).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        every: int = 0,
        data: Any | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.every = every
        self.data = data
        self.extra = extra
        self.saved_step: int | None = None

    def _write(self, trainer: Trainer, path: Path) -> Path:
        """Save to ``path``; when that fails for lack of memory or space, free what the step held
        and try once more; when it still fails, save to a rescue folder and say so.

        Raises:
            StateError: ``path`` could not be written (the message names where the state
                went instead, or the last state on disk).
        """
        reason = self._try(trainer, path)
        if reason is not None and _lack_of_room(reason):
            _free_memory(trainer)
            reason = self._try(trainer, path)
        if reason is None:
            return path
        # The rescue folder is on another file system path, so a full or read-only output
        # directory does not lose the steps since the last save.
        rescue = Path(tempfile.gettempdir()) / f"memfit-rescue-{os.getpid()}" / path.name
        if self._try(trainer, rescue) is not None:
            kept = f"the last state on disk is {str(path)!r}" if path.exists() else "no state is on disk"
            raise StateError(
                f"cannot write the training state {str(path)!r} ({reason}), nor a rescue copy; {kept}."
            )
        raise StateError(
            f"cannot write the training state {str(path)!r} ({reason}); the state of step "
            f"{trainer.step_count} was saved to {str(rescue)!r} instead: make {str(path.parent)!r} writable, "
            f"with room, and resume with memfit train --resume {rescue} --set train.out='{path.parent}'."
        )

    def _try(self, trainer: Trainer, path: Path) -> str | None:
        """Save to ``path``; None when it worked, else why not (a failure to write or to allocate)."""
        try:
            trainer.save(path, data=self.data, extra=self.extra)
        except OSError as exc:
            return exc.strerror or str(exc)
        except (MemoryError, RuntimeError) as exc:
            if not (is_out_of_memory(exc) or _is_write_failure(exc)):
                raise
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            if is_out_of_memory(exc):
                return f"out of memory: {first}"
            return f"the write stopped part-way, for lack of space or memory: {first}"
        return None

    def _save(self, trainer: Trainer) -> None:
        self._write(trainer, self.path)
        self.saved_step = trainer.step_count

    def save_last_good(self, trainer: Trainer) -> Path:
        """Write the last good state as ``last-good.pt`` beside :attr:`path`; returns its path.

        The data position is the one after the failed batch, so resuming from it skips
        that batch; model, optimizer and step count are those before the failed step.
        """
        return self._write(trainer, self.path.with_name("last-good.pt"))

    def on_step_end(self, trainer: Trainer, metrics: StepMetrics) -> None:
        """Save when the step number is a multiple of ``every``."""
        if self.every and trainer.step_count % self.every == 0:
            self._save(trainer)

    def on_fit_end(self, trainer: Trainer) -> None:
        """Save the final state (unless this step was just saved, or fit was interrupted in
        the middle of a step, which would leave a half-updated model)."""
        if trainer.fit_completed and self.saved_step != trainer.step_count:
            self._save(trainer)
