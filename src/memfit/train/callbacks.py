"""Trainer callbacks that write to disk: a metrics log and periodic training-state saves.

Trade-off: the metrics log is flushed after every line so a killed run leaves every
finished step on disk, at the cost of one small write per step.

Example:
    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> from memfit.train.trainer import Trainer
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

import json
import os
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from memfit.records import StepMetrics

if TYPE_CHECKING:
    from memfit.train.trainer import Trainer

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


def read_metrics(path: str | os.PathLike[str]) -> list[StepMetrics]:
    """Read a ``metrics.jsonl``; a last line cut short by a crash is skipped."""
    rows = []
    p = Path(path)
    if not p.exists():
        return []
    for line in p.read_text(encoding="utf-8").splitlines():
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
        with self.path.open("w", encoding="utf-8") as f:
            for m in kept:
                f.write(m.to_json(indent=None) + "\n")
        self._file: IO[str] | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        """Open the file for appending."""
        self._file = self.path.open("a", encoding="utf-8")

    def on_step_end(self, trainer: Trainer, metrics: StepMetrics) -> None:
        """Write and flush the step's line."""
        if self._file is None:
            self.on_fit_start(trainer)
        assert self._file is not None
        self._file.write(metrics.to_json(indent=None) + "\n")
        self._file.flush()

    def on_fit_end(self, trainer: Trainer) -> None:
        """Close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


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

    def _save(self, trainer: Trainer) -> None:
        trainer.save(self.path, data=self.data, extra=self.extra)
        self.saved_step = trainer.step_count

    def save_last_good(self, trainer: Trainer) -> Path:
        """Write the last good state as ``last-good.pt`` beside :attr:`path` (the guard calls
        this before stopping on a non-finite loss); returns its path.

        The data position is the one after the failed batch, so resuming from it skips
        that batch; model, optimizer and step count are those before the failed step.
        """
        path = self.path.with_name("last-good.pt")
        trainer.save(path, data=self.data, extra=self.extra)
        return path

    def on_step_end(self, trainer: Trainer, metrics: StepMetrics) -> None:
        """Save when the step number is a multiple of ``every``."""
        if self.every and trainer.step_count % self.every == 0:
            self._save(trainer)

    def on_fit_end(self, trainer: Trainer) -> None:
        """Save the final state (unless this step was just saved, or fit was interrupted in
        the middle of a step, which would leave a half-updated model)."""
        if trainer.fit_completed and self.saved_step != trainer.step_count:
            self._save(trainer)
