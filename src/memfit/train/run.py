"""A whole training run from a :class:`memfit.config.Config`: what ``memfit train`` does.

Builds the model, data, optimizer and schedule from the config, applies the precision and
checkpointing it names, trains with :class:`memfit.Trainer`, and writes ``metrics.jsonl``,
``state.pt`` (every ``train.checkpoint_every`` steps and at the end) and ``report.md`` to
``train.out``. ``resume`` continues a run from its saved state, bit for bit on a CPU.

Trade-off: a resumed run must use the settings that shape the numbers (model, data,
optimizer, precision, batch, seed); it refuses a config that changes them rather than
continuing a different run from the old weights.

Example:
    >>> import tempfile
    >>> from memfit.config import load_config
    >>> out = tempfile.mkdtemp()
    >>> cfg = load_config(None, ["model.n_layer=1", "model.n_embd=16", "model.n_head=2",
    ...     "model.block_size=8", "data.max_bytes=20000", "train.steps=2", f"train.out='{out}'"])
    >>> run = train_from_config(cfg, progress=False, echo=lambda _: None)
    >>> [m.step for m in run.history], run.state_path.name
    ([1, 2], 'state.pt')
"""

from __future__ import annotations

import contextlib
import random
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.apply import apply
from memfit.budget import Budget, format_bytes
from memfit.check.guards import GuardConfig
from memfit.checkpointing import checkpoint, checkpointed_blocks, find_blocks
from memfit.config import Config
from memfit.errors import ConfigError, StateError
from memfit.planning.planner import plan
from memfit.precision import Precision
from memfit.records import Plan, StepMetrics
from memfit.report.table import mode_counts
from memfit.report.training import summarize, training_report
from memfit.train.build import build_model
from memfit.train.callbacks import MetricsLog, SaveState, read_metrics
from memfit.train.data import BatchSampler, ByteCorpus, SyntheticBatches
from memfit.train.distributed import init_distributed, wrap_model
from memfit.train.schedule import lr_schedule
from memfit.train.sharded_state import load_sharded
from memfit.train.state import load_state, previous_path
from memfit.train.trainer import Callback, Trainer

__all__ = ["INTERRUPTED", "TrainRun", "resolve_resume", "train_from_config"]

#: ``Trainer.stop_reason`` after a Ctrl-C.
INTERRUPTED = "interrupted (Ctrl-C)"

#: Config keys a resumed run must share with the run it continues.
_MUST_MATCH = (
    "model",
    "data",
    "optimizer",
    "memory.precision",
    "train.batch_size",
    "train.grad_accum",
    "train.seed",
    "train.distributed",
)


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


def resolve_resume(resume: str, out: Path) -> Path:
    """The state file ``--resume`` means: ``"auto"`` is ``OUT/state.pt`` (or, if a crash came
    between its two renames, ``OUT/state.prev.pt``); anything else is a path."""
    if resume != "auto":
        return Path(resume)
    path = out / "state.pt"
    if not path.exists() and previous_path(path).exists():
        return previous_path(path)
    if not path.exists():
        raise StateError(
            f"nothing to resume in {str(out)!r}: it has no state.pt; run without --resume to start."
        )
    return path


def _get(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part, {}) if isinstance(tree, dict) else {}
    return tree


def _check_same_run(saved: dict[str, Any], cfg: Config, path: Path) -> None:
    now = cfg.to_dict()
    for key in _MUST_MATCH:
        before, after = _get(saved, key), _get(now, key)
        if key == "train.distributed" and before == {} and after == "none":
            continue  # NOTE: a state saved before train.distributed existed: one process
        if before != after:
            if isinstance(before, dict) and isinstance(after, dict):
                sub = next(k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k))
                key, before, after = f"{key}.{sub}", before.get(sub), after.get(sub)
            raise StateError(
                f"{str(path)!r} was trained with {key} = {before!r} but this config has {after!r}; "
                f"use the same value to resume, or set train.out to start a new run."
            )


def _schedule(optimizer: torch.optim.Optimizer, cfg: Config) -> torch.optim.lr_scheduler.LambdaLR:
    return lr_schedule(optimizer, cfg.train.steps, cfg.optimizer.warmup_steps, cfg.optimizer.schedule)


def _check_auto(cfg: Config) -> None:
    if cfg.memory.checkpointing != "auto":
        return
    if not cfg.memory.budget:
        raise ConfigError(
            'memory.checkpointing = "auto" plans to a budget: set memory.budget, e.g. "60%" or "2GiB".'
        )
    if cfg.train.distributed != "none":
        raise ConfigError(
            f'memory.checkpointing = "auto" plans for one process, not train.distributed = '
            f'"{cfg.train.distributed}"; choose none, full, selective or every:K for a torchrun run.'
        )


def _optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optimizer.lr,
        betas=(cfg.optimizer.betas[0], cfg.optimizer.betas[1]),
        eps=cfg.optimizer.eps,
        weight_decay=cfg.optimizer.weight_decay,
    )


def _describe_plan(chosen: Plan) -> str:
    counts = mode_counts(chosen.blocks.values())
    modes = ", ".join(f"{n} {m}" for m, n in sorted(counts.items())) or "no blocks"
    return (
        f"planned to {format_bytes(chosen.budget_bytes)} ({modes}; {chosen.micro_batches} micro-batch(es); "
        f"predicted peak {format_bytes(chosen.predicted_peak_bytes)})"
    )


def _apply_checkpointing(model: torch.nn.Module, mode: str) -> str:
    if mode == "none":
        return "none"
    if mode.startswith("every:"):
        every = int(mode.split(":")[1])
        checkpoint(model, mode="full", every=every)
        return f"full on every {every} blocks ({', '.join(checkpointed_blocks(model))})"
    checkpoint(model, mode=mode)
    return mode


class _BudgetWatch(Callback):
    """Warn once when a tracked step's peak is over ``memory.budget``."""

    def __init__(self, budget: int, echo: Callable[[str], None]) -> None:
        self.budget = budget
        self.echo = echo
        self.verdict: str | None = None

    def on_step_end(self, trainer: Trainer, metrics: StepMetrics) -> None:
        if self.verdict is not None or trainer.memory is None or not metrics.tracked:
            return
        peak = trainer.memory.peak_bytes
        fits = peak <= self.budget
        where = "within" if fits else "OVER"
        self.verdict = f"peak {format_bytes(peak)} is {where} memory.budget {format_bytes(self.budget)}"
        if not fits:
            print(
                f"memfit train: warning: {self.verdict}; use more checkpointing or a lower precision.",
                file=sys.stderr,
            )


class _Echo(Callback):
    """Print a line at each evaluation when there is no progress bar."""

    def __init__(self, echo: Callable[[str], None], total: int) -> None:
        self.echo = echo
        self.total = total

    def on_step_end(self, trainer: Trainer, metrics: StepMetrics) -> None:
        if metrics.val_loss is not None:
            self.echo(
                f"step {metrics.step}/{self.total}  loss {metrics.loss:.4f}  val {metrics.val_loss:.4f}  "
                f"{metrics.tokens_per_s:,.0f} tok/s"
            )


@contextlib.contextmanager
def _graceful_interrupt(trainer: Trainer, echo: Callable[[str], None]) -> Iterator[None]:
    """The first Ctrl-C stops training after the current step (whose state is then saved);
    a second one interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _on_sigint(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, previous)
        trainer.stop(INTERRUPTED)
        echo("memfit train: stopping after this step and saving the training state (Ctrl-C again to abort)")

    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _data(cfg: Config, spec: Any) -> tuple[Any, list[Any], str]:
    bs, seed = cfg.train.batch_size, cfg.train.seed
    if spec.seq_len is None:
        if spec.make_batch is None:
            raise ConfigError("the model factory's ModelSpec has neither seq_len nor make_batch; set one.")
        val = SyntheticBatches(spec.make_batch, bs, seed + 1)
        batches = [val.batch_at(i) for i in range(cfg.train.eval_batches)]
        return SyntheticBatches(spec.make_batch, bs, seed), batches, "the model's own make_batch"
    corpus = ByteCorpus.load(cfg.data.path, cfg.data.val_fraction, cfg.data.max_bytes)
    sampler = BatchSampler(corpus.train, bs, spec.seq_len, seed)
    val_sampler = BatchSampler(corpus.val, bs, spec.seq_len, seed + 1)
    val_batches = [val_sampler.batch_at(i) for i in range(cfg.train.eval_batches)]
    size = len(corpus.train) + len(corpus.val)
    return sampler, val_batches, f"{corpus.source} ({format_bytes(size)}, byte-level)"


def train_from_config(
    cfg: Config,
    resume: str | None = None,
    progress: bool | None = None,
    echo: Callable[[str], None] = print,
    overwrite: bool = False,
) -> TrainRun:
    """Train as ``cfg`` says; ``resume`` is ``"auto"`` or a state file to continue from.

    A new run (no ``resume``) refuses a ``train.out`` that already holds one, unless
    ``overwrite`` is set, so an earlier run's metrics and state are never lost by accident.

    Returns:
        A :class:`TrainRun` with the trainer, every step's metrics and the files written.

    Raises:
        MemfitError: a bad config, data path, model factory or state file (one sentence).
    """
    out = Path(cfg.train.out)
    _check_auto(cfg)
    budget_text = cfg.memory.budget
    budget = None
    if budget_text:
        # A percentage is of the fp32 no-checkpointing peak: the planner measures it.
        budget = Budget.parse(budget_text, what="memory.budget").bytes
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = device if cfg.train.device == "auto" else torch.device(cfg.train.device)
    state_path = resolve_resume(resume, out) if resume else None
    if (
        state_path is None
        and not overwrite
        and any((out / n).exists() for n in ("state.pt", "metrics.jsonl"))
    ):
        raise ConfigError(
            f"{str(out)!r} already holds a training run; continue it with --resume, start over with "
            "--overwrite, or set train.out to another directory."
        )
    # NOTE: every rank checks the files above before joining the process group, so no rank
    # can have written anything yet.
    dist_ctx, device = init_distributed(cfg.train.distributed, device)
    if not dist_ctx.is_main:
        echo, progress = (lambda _line: None), False
    precision = Precision(cfg.memory.precision, device=device, fp32_modules=cfg.memory.fp32_modules)
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    spec = build_model(cfg.model)
    sampler, val_batches, data_text = _data(cfg, spec)
    model = spec.model.to(device)
    opt = _optimizer(model, cfg)
    chosen: Plan | None = None
    if cfg.memory.checkpointing == "auto":
        chosen = plan(model, sampler.batch_at(0), spec.loss_fn, budget_text, opt, cfg.memory.precision)
        apply(model, chosen)
        budget = chosen.budget_bytes
        precision = Precision(chosen.precision, device=device, fp32_modules=cfg.memory.fp32_modules)
        ckpt_text = _describe_plan(chosen)
    else:
        ckpt_text = _apply_checkpointing(model, cfg.memory.checkpointing)
    n_params = sum(p.numel() for p in model.parameters())
    model_name = type(model).__name__
    if dist_ctx.active:
        # NOTE: wrap after checkpointing (fully_shard keeps the blocks' forward overrides) and
        # build the optimizer after wrapping (FSDP2 replaces the parameters with DTensors).
        model = wrap_model(model, dist_ctx, find_blocks(model))
        opt = _optimizer(model, cfg)
    trainer = Trainer(
        model,
        opt,
        spec.loss_fn,
        precision,
        chosen,
        micro_batches=chosen.micro_batches if chosen else cfg.train.grad_accum,
        clip_norm=cfg.optimizer.clip_norm or None,
        scheduler=_schedule(opt, cfg),
        progress=progress,
        dist=dist_ctx,
        guard=GuardConfig(on_overflow=cfg.memory.on_overflow),
    )
    resumed_from = None
    if state_path is not None:
        state = load_state(state_path)
        _check_same_run(dict(state.get("extra") or {}).get("config", {}), cfg, state_path)
        if state.get("sharded"):
            load_sharded(trainer.model, trainer.optimizer, state_path)
        trainer.load_state_dict(state, data=sampler)
        resumed_from = trainer.step_count
    files = {"metrics": out / "metrics.jsonl", "state": out / "state.pt", "report": out / "report.md"}
    watch = _BudgetWatch(budget, echo) if budget else None
    save = SaveState(files["state"], cfg.train.checkpoint_every, sampler, {"config": cfg.to_dict()})
    if not dist_ctx.is_main:
        # NOTE: other ranks only take part in saving (FSDP2 shards); rank 0 writes the rest.
        trainer.callbacks.append(save)
    else:
        trainer.callbacks += [
            MetricsLog(files["metrics"], keep_until=resumed_from),
            save,
            *([watch] if watch else []),
            *(
                [_Echo(echo, cfg.train.steps)]
                if not trainer.progress_enabled() and progress is not False
                else []
            ),
        ]
    remaining = max(0, cfg.train.steps - trainer.step_count)
    echo(
        f"memfit train: {model_name} ({n_params / 1e6:.2f}M parameters) on {data_text}, "
        f"{precision.mode}, checkpointing {ckpt_text}, {device}"
        + (f" x {dist_ctx.world_size} ({dist_ctx.mode})" if dist_ctx.active else "")
        + "; "
        + (f"resuming at step {resumed_from}, " if resumed_from is not None else "")
        + f"{remaining} steps to {cfg.train.steps}"
    )
    with _graceful_interrupt(trainer, echo):
        trainer.fit(
            sampler,
            remaining,
            eval_fn=lambda _m: trainer.evaluate(val_batches),
            eval_every=cfg.train.eval_every or None,
        )
    if not dist_ctx.is_main:
        return TrainRun(
            out=out, trainer=trainer, history=trainer.history, resumed_from=resumed_from, files={}
        )
    history = read_metrics(files["metrics"])
    settings = {
        "model": f"{cfg.model.name} ({n_params:,} parameters)",
        "data": data_text,
        "precision": f"{precision.mode} ({precision.reason})",
        "checkpointing": ckpt_text,
        "batch": f"{cfg.train.batch_size} in {cfg.train.grad_accum} micro-batch(es)",
        "optimizer": (
            f"AdamW lr {cfg.optimizer.lr:g}, {cfg.optimizer.schedule} schedule, "
            f"{cfg.optimizer.warmup_steps} warm-up steps"
        ),
        "device": str(device)
        + (f", {dist_ctx.world_size} processes ({dist_ctx.mode})" if dist_ctx.active else ""),
        "seed": str(cfg.train.seed),
    }
    notes = [f"resumed from {state_path} at step {resumed_from}"] if resumed_from is not None else []
    if watch and watch.verdict:
        notes.append(watch.verdict)
    if trainer.stop_reason:
        notes.append(f"stopped early: {trainer.stop_reason}")
    notes += [f"guard, step {e.step}: {e.message}" for e in trainer.guard.events]
    files["report"].write_text(
        training_report("memfit train", history, trainer.memory, settings, notes), encoding="utf-8"
    )
    s = summarize(history)
    echo(
        f"done: {s.steps} steps, train loss {s.first_loss:.4f} -> {s.final_loss:.4f}"
        + (f", val loss {s.val_loss:.4f}" if s.val_loss is not None else "")
        + (f", peak {format_bytes(trainer.memory.peak_bytes)}" if trainer.memory else "")
        + f"; wrote {', '.join(str(p) for p in files.values())}"
    )
    return TrainRun(out=out, trainer=trainer, history=history, resumed_from=resumed_from, files=files)
