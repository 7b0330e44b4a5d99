"""What ``memfit train`` says about a run: lines while it trains, and ``report.md`` at the end.

Trade-off: the report is rebuilt from ``metrics.jsonl`` (every step, including those before
a resume) rather than from memory, so a resumed run's report covers the whole run.

Example:
    >>> watch = BudgetWatch(1000)
    >>> watch.verdict is None
    True
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from memfit.app.config import Config
from memfit.budget import format_bytes
from memfit.errors import StateError
from memfit.outputs import write_text
from memfit.records import StepMetrics
from memfit.report.plots import training_plots
from memfit.report.training import summarize, training_report
from memfit.trainer.callbacks import Callback
from memfit.trainer.trainer import Trainer

__all__ = [
    "BudgetWatch",
    "EchoEvaluations",
    "done_line",
    "run_notes",
    "run_settings",
    "write_plots",
    "write_report",
]


class BudgetWatch(Callback):
    """Warn once when a tracked step's peak is over ``memory.budget``."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.verdict: str | None = None

    def on_step_end(self, trainer: Trainer, metrics: StepMetrics) -> None:
        """Judge the first tracked step (and the first after a re-plan)."""
        if trainer.memory is None or not metrics.tracked:
            return
        if self.verdict is not None and not trainer.replans:
            return
        peak = trainer.memory.peak_bytes
        fits = peak <= self.budget
        where = "within" if fits else "OVER"
        verdict = f"peak {format_bytes(peak)} is {where} memory.budget {format_bytes(self.budget)}"
        if verdict == self.verdict:
            return
        self.verdict = verdict
        if not fits:
            print(
                f"memfit train: warning: {self.verdict}; use more checkpointing or a lower precision.",
                file=sys.stderr,
            )


class EchoEvaluations(Callback):
    """Print a line at each evaluation when there is no progress bar."""

    def __init__(self, echo: Callable[[str], None], total: int) -> None:
        self.echo = echo
        self.total = total

    def on_step_end(self, trainer: Trainer, metrics: StepMetrics) -> None:
        """Print the step's losses and speed when it was evaluated."""
        if metrics.val_loss is not None:
            self.echo(
                f"step {metrics.step}/{self.total}  loss {metrics.loss:.4f}  val {metrics.val_loss:.4f}  "
                f"{metrics.tokens_per_s:,.0f} tok/s"
            )


def run_settings(
    cfg: Config, trainer: Trainer, n_params: int, data_text: str, checkpointing_text: str
) -> dict[str, str]:
    """The settings table of ``report.md``."""
    precision, dist = trainer.precision, trainer.dist
    return {
        "model": f"{cfg.model.name} ({n_params:,} parameters)",
        "data": data_text,
        "precision": f"{precision.mode} ({precision.reason})",
        "checkpointing": checkpointing_text,
        "batch": f"{cfg.train.batch_size} in {cfg.train.grad_accum} micro-batch(es)",
        "optimizer": (
            f"AdamW lr {cfg.optimizer.lr:g}, {cfg.optimizer.schedule} schedule, "
            f"{cfg.optimizer.warmup_steps} warm-up steps"
        ),
        "device": str(trainer.device)
        + (f", {dist.world_size} processes ({dist.mode})" if dist.active else "")
        + (", compiled (torch.compile)" if cfg.train.compile else ""),
        "seed": str(cfg.train.seed),
    }


def run_notes(
    trainer: Trainer,
    resumed: tuple[Path, int] | None,
    resume_notes: Sequence[str],
    watch: BudgetWatch | None,
) -> list[str]:
    """The notes of ``report.md``: resume, changes, budget verdict, early stop, guard and re-plans."""
    notes = [f"resumed from {resumed[0]} at step {resumed[1]}"] if resumed is not None else []
    notes += list(resume_notes)
    if watch and watch.verdict:
        notes.append(watch.verdict)
    if trainer.memory_note:
        notes.append(f"memory: {trainer.memory_note}")
    if trainer.stop_reason:
        notes.append(f"stopped early: {trainer.stop_reason}")
    notes += [f"guard, step {e.step}: {e.message}" for e in trainer.guard.events]
    notes += [f"out of memory: {e.message}" for e in trainer.replans]
    return notes


def write_report(
    path: Path,
    history: Sequence[StepMetrics],
    trainer: Trainer,
    settings: dict[str, str],
    notes: list[str],
    images: Sequence[str] = (),
) -> None:
    """Write ``report.md`` (atomically), showing ``images`` (file names beside it).

    Raises:
        StateError: it cannot be written; the message says where the state and metrics are.
    """
    text = training_report("memfit train", history, trainer.memory, settings, notes, images)
    try:
        write_text(path, text, "the report")
    except Exception as exc:
        raise StateError(
            f"{str(exc).rstrip('.')}; the training state and metrics.jsonl beside it are complete."
        ) from None


def write_plots(
    out: Path, history: Sequence[StepMetrics], trainer: Trainer, budget: int | None, title: str
) -> tuple[dict[str, Path], str | None]:
    """``loss.png`` and ``memory.png`` in ``out``: the files written, and why not, if they were not."""
    breakdown = trainer.memory.breakdown if trainer.memory else None
    try:
        return training_plots(out, history, breakdown, budget, title), None
    except OSError as exc:
        return {}, f"cannot write the plots in {str(out)!r} ({exc.strerror or exc})"


def done_line(history: Sequence[StepMetrics], trainer: Trainer, files: dict[str, Path]) -> str:
    """The last line ``memfit train`` prints."""
    s = summarize(history)
    return (
        f"done: {s.steps} steps, train loss {s.first_loss:.4f} -> {s.final_loss:.4f}"
        + (f", val loss {s.val_loss:.4f}" if s.val_loss is not None else "")
        + (f", peak {format_bytes(trainer.memory.peak_bytes)}" if trainer.memory else "")
        + f"; wrote {', '.join(str(p) for p in files.values())}"
    )
