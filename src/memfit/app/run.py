"""A whole training run from a :class:`memfit.app.config.Config`: what ``memfit train`` does.

Three steps, each in its own module: check and build the run (:mod:`memfit.app.setup`),
resume it if asked (:mod:`memfit.app.resume`), train with :class:`memfit.Trainer`, and
report (:mod:`memfit.app.run_report`). It writes ``metrics.jsonl``, ``state.pt`` (every
``train.checkpoint_every`` steps and at the end), ``report.md``, ``loss.png`` and
``memory.png`` to ``train.out`` (and ``ranks.json`` under torchrun).
``resume`` continues a run from its saved state, bit for bit on a CPU.

Trade-off: a resumed run must use the settings that shape the numbers (model, data,
optimizer, precision, batch, seed); it refuses a config that changes them rather than
continuing a different run from the old weights.

Example:
    >>> import tempfile
    >>> from memfit.app.config import load_config
    >>> out = tempfile.mkdtemp()
    >>> cfg = load_config(None, ["model.n_layer=1", "model.n_embd=16", "model.n_head=2",
    ...     "model.block_size=8", "data.max_bytes=20000", "train.steps=2", f"train.out='{out}'"])
    >>> run = train_from_config(cfg, progress=False, echo=lambda _: None)
    >>> [m.step for m in run.history], run.state_path.name
    ([1, 2], 'state.pt')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memfit.app.config import Config
from memfit.app.dist_plan import rank_notes
from memfit.app.resume import Resumed, print_notes, resume_run
from memfit.app.run_report import (
    BudgetWatch,
    EchoEvaluations,
    done_line,
    run_notes,
    run_settings,
    write_plots,
    write_report,
)
from memfit.app.setup import build_run, check_run
from memfit.errors import StateError
from memfit.records import Plan, StepMetrics
from memfit.trainer.callbacks import MetricsLog, SaveState, read_metrics
from memfit.trainer.distributed import DistContext, init_distributed, shutdown_distributed
from memfit.trainer.signals import graceful_stop
from memfit.trainer.trainer import Trainer

__all__ = ["TrainRun", "train_from_config"]


@dataclass
class TrainRun:
    """What a run left behind."""

    out: Path
    trainer: Trainer
    history: list[StepMetrics]
    """Every step's metrics, including those before a resume."""
    resumed_from: int | None = None
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def state_path(self) -> Path:
        """The final training state."""
        return self.files["state"]


def train_from_config(
    cfg: Config,
    resume: str | None = None,
    progress: bool | None = None,
    echo: Callable[[str], None] = print,
    overwrite: bool = False,
    *,
    overrides: Sequence[str] | None = None,
    plan: Plan | None = None,
) -> TrainRun:
    """Train as ``cfg`` says; ``resume`` is ``"auto"`` or a state file to continue from.

    A new run (no ``resume``) refuses a ``train.out`` that already holds one, unless
    ``overwrite`` is set, so an earlier run's metrics and state are never lost by accident;
    ``resume="auto"`` of a run stopped before it saved any state starts it again from step 0.
    Ctrl-C, SIGTERM and SIGHUP stop it after the step in flight, whose state is saved
    (:mod:`memfit.trainer.signals`; ``trainer.stop_reason`` says which).
    When resuming with ``overrides`` (``--set`` options of a command line without a config
    file), the run goes on with its saved config plus those (see :mod:`memfit.app.resume`).
    With ``plan`` (``memfit train --plan``) the run trains with that decision as it is: nothing is
    profiled or planned, and a plan made for another model, batch or device is refused.

    Returns:
        A :class:`TrainRun` with the trainer, every step's metrics and the files written.

    Raises:
        MemfitError: a bad config, data path, model factory or state file, or a failure to
            write (one sentence; what is on disk is kept and named).
    """
    resumed: Resumed | None = None
    if resume:
        resumed = resume_run(resume, cfg, overrides)
        if resumed is None:
            where = repr(cfg.train.out)
            print_notes(
                [f"{where} holds a run stopped before it saved any state; it starts again from step 0"]
            )
        cfg = resumed.cfg if resumed is not None else cfg
    device = check_run(cfg, resume, overwrite, plan=plan)
    out = Path(cfg.train.out)
    # Every rank checks the files above before joining the process group, so no rank can
    # have written anything yet.
    dist_ctx, device = init_distributed(cfg.train.distributed, device)
    finished = False
    try:
        run = _train_joined(cfg, resumed, out, device, dist_ctx, progress, echo, plan)
        finished = True
        return run
    finally:
        shutdown_distributed(dist_ctx, finished)


def _train_joined(
    cfg: Config,
    resumed: Resumed | None,
    out: Path,
    device: torch.device,
    dist_ctx: DistContext,
    progress: bool | None,
    echo: Callable[[str], None],
    plan: Plan | None = None,
) -> TrainRun:
    """The run once this process has joined its process group (if any): build, fit, report."""
    if not dist_ctx.is_main:
        echo, progress = (lambda _line: None), False
    built = build_run(cfg, device, dist_ctx, progress, plan)
    trainer = built.trainer
    resumed_from = None
    if resumed is not None:
        trainer.load(resumed.path, data=built.sampler)
        resumed_from = trainer.step_count
        if dist_ctx.is_main:
            print_notes(resumed.notes)
    files = {"metrics": out / "metrics.jsonl", "state": out / "state.pt", "report": out / "report.md"}
    watch = BudgetWatch(built.budget) if built.budget else None
    save = SaveState(files["state"], cfg.train.checkpoint_every, built.sampler, {"config": cfg.to_dict()})
    log = MetricsLog(files["metrics"], keep_until=resumed_from) if dist_ctx.is_main else None
    if log is None:
        # Other ranks only take part in saving (FSDP2 shards); rank 0 writes the rest.
        trainer.callbacks.append(save)
    else:
        quiet_bar = not trainer.progress_enabled() and progress is not False
        trainer.callbacks += [
            log,
            save,
            *([watch] if watch else []),
            *([EchoEvaluations(echo, cfg.train.steps)] if quiet_bar else []),
        ]
    remaining = max(0, cfg.train.steps - trainer.step_count)
    echo(
        f"memfit train: {built.model_name} ({built.n_params / 1e6:.2f}M parameters) on {built.data_text}, "
        f"{trainer.precision.mode}, checkpointing {built.checkpointing_text}, {device}"
        + (f", frozen base {built.base_text}" if built.base_text else "")
        + (f" x {dist_ctx.world_size} ({dist_ctx.mode})" if dist_ctx.active else "")
        + "; "
        + (f"resuming at step {resumed_from}, " if resumed_from is not None else "")
        + f"{remaining} steps to {cfg.train.steps}"
    )
    with graceful_stop(trainer, echo):
        trainer.fit(
            built.sampler,
            remaining,
            eval_fn=lambda _m: trainer.evaluate(built.val_batches),
            eval_every=cfg.train.eval_every or None,
        )
    for event in trainer.replans:
        echo(f"memfit train: {event.message}")
    ranks = rank_notes(trainer, dist_ctx, out, built.budget)
    if log is None:
        return TrainRun(out=out, trainer=trainer, history=trainer.history, resumed_from=resumed_from)
    if log.error:
        raise StateError(
            f"{log.error}, so training stopped after step {trainer.step_count}; its state is in "
            f"{files['state']} (resume with memfit train --resume {files['state']})."
        )
    history = read_metrics(files["metrics"])
    settings = run_settings(cfg, trainer, built.n_params, built.data_text, built.checkpointing_text)
    if built.base_text:
        settings["frozen base"] = built.base_text
    where = (resumed.path, resumed_from) if resumed is not None and resumed_from is not None else None
    notes = run_notes(trainer, where, resumed.notes if resumed else [], watch) + ranks
    notes += [f"planning: {m}" for m in built.plan.report.measured] if built.plan is not None else []
    plots, failed = write_plots(out, history, trainer, built.budget, f"memfit train: {cfg.model.name}")
    files.update(plots)
    images = [files[k].name for k in ("loss", "memory") if k in files]
    write_report(files["report"], history, trainer, settings, [*notes, *([failed] if failed else [])], images)
    if failed:
        raise StateError(
            f"{failed}; the training state, metrics.jsonl and report.md beside them are complete."
        )
    echo(done_line(history, trainer, files))
    return TrainRun(out=out, trainer=trainer, history=history, resumed_from=resumed_from, files=files)
