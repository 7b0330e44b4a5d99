"""Building a run from its config: checks first, then data, model, optimizer, plan and Trainer.

:func:`check_run` refuses everything that can be refused without building the model (the
output directory, an existing run, the device, ``checkpointing = "auto"`` without what it
needs), so nothing is written and no time is spent before a bad config is named.
:func:`build_run` then seeds the random generators and builds, in order, the data, the
model and its optimizer, the checkpointing (or the plan, for ``"auto"``) and the Trainer.

Trade-off: ``checkpointing = "auto"`` profiles the model before training (seconds); the
profiles are kept, so a step that later runs out of memory is re-planned without profiling.

Example:
    >>> import tempfile
    >>> from memfit.app.config import load_config
    >>> cfg = load_config(None, ["model.n_layer=1", "model.n_embd=16", "model.n_head=2",
    ...     "model.block_size=8", "train.device='cpu'", f"train.out='{tempfile.mkdtemp()}'"])
    >>> check_run(cfg, resume=None, overwrite=False).type
    'cpu'
"""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from memfit.app.build import base_refusal, build_model, run_precision, store_frozen_base
from memfit.app.config import Config
from memfit.app.data import BatchSampler, ByteCorpus, SyntheticBatches
from memfit.app.dist_plan import plan_for_ranks
from memfit.app.schedule import lr_schedule
from memfit.applying import apply, check_made_for
from memfit.budget import Budget, format_bytes
from memfit.check.guards import GuardConfig
from memfit.checkpointing import checkpoint, checkpointed_blocks, find_blocks
from memfit.devices import model_device, resolve_device, room
from memfit.errors import ConfigError
from memfit.models.spec import ModelSpec
from memfit.outputs import check_output_dir
from memfit.planning.budgets import refuse_over_room
from memfit.planning.planner import plan
from memfit.precision import Precision
from memfit.progress import configured
from memfit.records import Plan, Profile
from memfit.report.table import mode_counts
from memfit.trainer.distributed import DistContext, wrap_model
from memfit.trainer.oom import OomConfig
from memfit.trainer.state import state_key
from memfit.trainer.trainer import Trainer
from memfit.vocab import normalize_mode

__all__ = ["BuiltRun", "build_run", "check_run"]


def check_run(cfg: Config, resume: str | None, overwrite: bool, plan: Plan | None = None) -> torch.device:
    """Refuse what can be refused before anything is built or written; returns the device.

    Raises:
        ConfigError: ``train.out`` is a file, cannot be written, or already holds a run
            (without ``resume`` or ``overwrite``); the device is not here (or not the one
            ``plan`` was made on); ``checkpointing = "auto"`` lacks a budget (and no plan is
            given), or the budget is more than the device has room for; or
            ``model.lora.base`` needs torchao, which is not installed.
        StateError: the state key cannot be read or made.
    """
    why = base_refusal(cfg.model.lora)
    if why is not None:
        raise ConfigError(why)
    out = check_output_dir(cfg.train.out, "train.out")
    if cfg.memory.checkpointing == "auto" and not cfg.memory.budget and plan is None:
        raise ConfigError(
            'memory.checkpointing = "auto" plans to a budget: set memory.budget, e.g. "60%" or "2GiB".'
        )
    if resume is None and not overwrite and any((out / n).exists() for n in ("state.pt", "metrics.jsonl")):
        raise ConfigError(
            f"{str(out)!r} already holds a training run; continue it with --resume, start over with "
            "--overwrite, or set train.out to another directory."
        )
    state_key()  # a key that cannot be read is refused now, not at the first save
    device = resolve_device(cfg.train.device)
    if plan is not None:
        check_made_for(plan, device=device)
        return device  # the plan decides: the config's budget is not planned to
    budget = Budget.parse(cfg.memory.budget, what="memory.budget") if cfg.memory.budget else None
    if budget is not None and budget.bytes is not None:  # nothing is built yet: all of it is room
        refuse_over_room(budget.bytes, budget, room(device), 0, device)
    return device


@dataclass
class BuiltRun:
    """What :func:`build_run` made, and how to describe it."""

    trainer: Trainer
    spec: ModelSpec
    sampler: Any
    val_batches: list[Any]
    data_text: str
    checkpointing_text: str
    budget: int | None
    """``memory.budget`` in bytes, once known (a percentage is resolved by the planner)."""
    n_params: int
    model_name: str
    base_text: str = ""
    """How the frozen base of ``[model.lora]`` is stored ("" without adapters)."""
    plan: Plan | None = None
    profiles: dict[str, Profile] = field(default_factory=dict)


def _data(cfg: Config, spec: ModelSpec) -> tuple[Any, list[Any], str]:
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


def _describe_plan(chosen: Plan, given: bool) -> str:
    counts = mode_counts(chosen.blocks.values())
    modes = ", ".join(f"{n} {m}" for m, n in sorted(counts.items())) or "no blocks"
    levers = f"; levers {', '.join(chosen.levers)}" if chosen.levers else ""
    how = "the plan given (--plan), made" if given else "planned"
    return (
        f"{how} to {format_bytes(chosen.budget_bytes)} ({modes}; {chosen.micro_batches} micro-batch(es)"
        f"{levers}; predicted peak {format_bytes(chosen.predicted_peak_bytes)})"
    )


def _apply_checkpointing(model: torch.nn.Module, mode: str) -> str:
    if mode == "none":
        return "none"
    if mode.startswith("every:"):
        every = int(mode.split(":")[1])
        checkpoint(model, mode="full", every=every)
        return f"full on every {every} blocks ({', '.join(checkpointed_blocks(model))})"
    checkpoint(model, mode=normalize_mode(mode, what="memory.checkpointing"))
    return mode


def _plan(
    cfg: Config,
    model: torch.nn.Module,
    sampler: Any,
    spec: ModelSpec,
    opt: torch.optim.Optimizer,
    dist_ctx: DistContext,
    profiles: dict[str, Profile],
) -> Plan | None:
    """The plan for ``memory.checkpointing = "auto"`` (None otherwise); ``profiles`` receives
    what planning measured, for a re-plan after running out of memory."""
    if cfg.memory.checkpointing != "auto":
        return None
    batch, budget, precision = sampler.batch_at(0), cfg.memory.budget, run_precision(cfg)
    if dist_ctx.active:
        # Planned on rank 0 for one rank's memory; every rank gets the same plan.
        return plan_for_ranks(model, batch, spec.loss_fn, budget, opt, precision, dist_ctx)
    return plan(model, batch, spec.loss_fn, budget, opt, precision, profiles=profiles)


def _decided(
    cfg: Config, model: torch.nn.Module, batch: Any, given: Plan | None, plan_it: Callable[[], Plan | None]
) -> tuple[Plan | None, str]:
    """The plan to train with and how to describe it: ``given`` as it is (checked against this
    model, batch and device; nothing profiled), else ``plan_it()`` (None: the config's own
    checkpointing, applied here)."""
    if given is not None:
        check_made_for(given, model=model, batch=batch, device=model_device(model))
        return given, _describe_plan(given, given=True)
    chosen = plan_it()
    if chosen is None:
        return None, _apply_checkpointing(model, cfg.memory.checkpointing)
    return chosen, _describe_plan(chosen, given=False)


def build_run(
    cfg: Config, device: torch.device, dist_ctx: DistContext, progress: bool | None, plan: Plan | None = None
) -> BuiltRun:
    """Seed, then build data, model, optimizer, checkpointing (or plan) and the Trainer.

    With ``plan`` (``memfit train --plan``) nothing is planned: the Trainer applies it as it is.

    Raises:
        MemfitError: a bad data path, model factory, a budget nothing fits, or a plan made for
            another model, batch or device (one sentence).
    """
    budget_text = cfg.memory.budget
    # A percentage is of the fp32 no-checkpointing peak: the planner measures it.
    budget = Budget.parse(budget_text, what="memory.budget").bytes if budget_text else None
    precision = Precision(run_precision(cfg), device=device, fp32_modules=cfg.memory.fp32_modules)
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    spec = build_model(cfg.model)
    sampler, val_batches, data_text = _data(cfg, spec)
    model = spec.model.to(device)
    base_text = store_frozen_base(model, cfg.model.lora) if cfg.model.lora.rank > 0 else ""
    opt = cfg.optimizer.make(model.parameters())
    profiles: dict[str, Profile] = {}
    with configured(quiet=True) if progress is False else nullcontext():  # --quiet: no planning lines
        chosen, ckpt_text = _decided(
            cfg,
            model,
            sampler.batch_at(0),
            plan,
            lambda: _plan(cfg, model, sampler, spec, opt, dist_ctx, profiles),
        )
    if chosen is not None:
        budget = chosen.budget_bytes or None
        precision = Precision(chosen.precision, device=device, fp32_modules=cfg.memory.fp32_modules)
    n_params = sum(p.numel() for p in model.parameters())
    model_name = type(model).__name__
    if dist_ctx.active:
        # Note [wrap after checkpointing]
        # Wrap after checkpointing (fully_shard keeps the blocks' forward overrides) and build
        # the optimizer after wrapping (FSDP2 replaces the parameters with DTensors); the
        # Trainer applies the rest of the plan to that optimizer.
        if chosen is not None:
            apply(model, replace(chosen, levers=[], lever_settings={}))
        model = wrap_model(model, dist_ctx, find_blocks(model))
        opt = cfg.optimizer.make(model.parameters())
    trainer = Trainer(
        model,
        opt,
        spec.loss_fn,
        precision,
        chosen,
        micro_batches=chosen.micro_batches if chosen else cfg.train.grad_accum,
        clip_norm=cfg.optimizer.clip_norm or None,
        scheduler=lr_schedule(opt, cfg.train.steps, cfg.optimizer.warmup_steps, cfg.optimizer.schedule),
        progress=progress,
        dist=dist_ctx,
        guard=GuardConfig(on_overflow=cfg.memory.on_overflow),
        oom=OomConfig(profiles=profiles),
        compile=cfg.train.compile,
    )
    return BuiltRun(
        trainer=trainer,
        spec=spec,
        sampler=sampler,
        val_batches=val_batches,
        data_text=data_text,
        checkpointing_text=ckpt_text,
        budget=budget,
        n_params=n_params,
        model_name=model_name,
        base_text=base_text,
        plan=chosen,
        profiles=profiles,
    )
