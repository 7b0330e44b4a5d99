"""One plan for every rank under ``torchrun``: planned on rank 0, broadcast, checked after training.

``memory.checkpointing = "auto"`` plans for the memory of one rank. Rank 0 profiles the
model (unwrapped, at the batch one rank computes: its slice of the global batch), turns the
profile into one rank's memory with :mod:`memfit.planning.sharding` (FSDP2: shards of
parameters, gradients and optimizer state plus each block's gathered parameters while it
computes; DDP: the whole model plus its gradient buckets) and solves against it with
:func:`memfit.planning.choose.plan_from_profiles`. A percentage budget is of the
predicted per-rank fp32 no-checkpointing peak.

The plan (or the error, as one sentence) is broadcast to every rank, so every rank applies
the same checkpointing, precision and micro-batches and FSDP2's collectives match. After
training :func:`gather_ranks` collects what each rank applied and its measured peak.

Trade-off: rank 0 plans alone while the others wait (a profile is a few steps), and the
plan is a prediction: it cannot be measured before the model is wrapped, so each rank's
peak is measured during training and reported (``ranks.json``, ``report.md``).

Example (inside ``torchrun``, after :func:`memfit.trainer.distributed.init_distributed`):
    ``chosen = plan_for_ranks(model, global_batch, loss_fn, "60%", opt, "auto", ctx)``
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memfit.budget import Budget, format_bytes
from memfit.checkpointing import checkpointed_blocks
from memfit.checkpointing.segments import applied_segments
from memfit.devices import model_device, room, unwrap
from memfit.errors import ConfigError, InfeasibleBudget, MemfitError
from memfit.measuring.profile import profile
from memfit.outputs import marked_json
from memfit.planning.budgets import held_bytes, resolve_in_room
from memfit.planning.choose import candidate_precisions, plan_from_profiles
from memfit.planning.sharding import rank_profile
from memfit.records import Plan
from memfit.step import Batch, LossFn
from memfit.stepmodel import simulate
from memfit.trainer.distributed import DistContext, local_batch
from memfit.vocab import PrecisionChoice, PrecisionName

__all__ = ["gather_ranks", "plan_for_ranks", "rank_notes"]


def _plan_rank(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    budget: Budget,
    optimizer: torch.optim.Optimizer | None,
    precision: PrecisionChoice,
    ctx: DistContext,
) -> Plan:
    device = model_device(model)
    wanted = candidate_precisions(precision, device)
    needed = [*wanted, *(["fp32"] if budget.is_fraction and "fp32" not in wanted else [])]
    ranked = {
        p: rank_profile(profile(model, batch, loss_fn, optimizer, p), ctx.mode, ctx.world_size)
        for p in needed
    }
    base = ranked.get("fp32")
    baseline = simulate(base, "none").peak_bytes if base is not None else 0
    seconds = base.step_seconds if base is not None else 0.0
    # Read before sharding: what this rank holds now plus its room (conservative).
    # See Note [room before the snapshot]
    budget_bytes = resolve_in_room(budget, baseline, room(device), held_bytes(model, optimizer), device)
    result = plan_from_profiles({p: ranked[p] for p in wanted}, budget_bytes, baseline, seconds)
    note = (
        f"{ctx.mode} over {ctx.world_size} processes: planned on rank 0 for one rank's memory "
        "(memfit.planning.sharding); each rank's peak is measured during training"
    )
    return replace(result, report=replace(result.report, notes=[*result.notes, note]))


def plan_for_ranks(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    budget: str | int | Budget,
    optimizer: torch.optim.Optimizer | None,
    precision: PrecisionChoice,
    ctx: DistContext,
) -> Plan:
    """The plan every rank runs: made on rank 0 for one rank's memory, then broadcast.

    Args:
        model: the unwrapped model (the same weights on every rank), before DDP/FSDP2.
        batch: the global batch (each rank computes its slice of it).
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        budget: the per-rank budget: bytes, ``"6GiB"`` or ``"60%"``.
        optimizer: the optimizer training will use (its state counts).
        precision: ``"auto"`` or one precision to plan with.
        ctx: this process's place in the run; ``ctx.mode`` is ``"ddp"`` or ``"fsdp2"``.

    Returns:
        The same :class:`memfit.Plan` on every rank.

    Raises:
        InfeasibleBudget: nothing fits (raised on every rank with rank 0's sentence).
        ConfigError: the budget cannot be read (likewise on every rank).
    """
    spec = Budget.parse(budget, what="memory.budget")
    payload: list[Any] = [None]
    if ctx.is_main:
        part = local_batch(batch, ctx)
        try:
            chosen = _plan_rank(model, part, loss_fn, spec, optimizer, precision, ctx)
            payload[0] = {"plan": chosen.to_dict()}
        except MemfitError as exc:
            # Every rank must leave the broadcast, with the same error, or the others hang.
            payload[0] = {
                "error": str(exc),
                "infeasible": isinstance(exc, InfeasibleBudget),
                "minimum": getattr(exc, "minimum_bytes", 0),
                "budget": getattr(exc, "budget_bytes", 0),
            }
    if ctx.active:
        dist.broadcast_object_list(payload, src=0)
    got = payload[0]
    if "error" in got:
        if got["infeasible"]:
            raise InfeasibleBudget(got["error"], got["minimum"], got["budget"])
        raise ConfigError(got["error"])
    return Plan.from_dict(got["plan"])


def gather_ranks(
    model: nn.Module, precision: PrecisionName, micro_batches: int, peak_bytes: int | None, ctx: DistContext
) -> list[dict[str, Any]]:
    """Every rank's applied checkpointing and segments, precision, micro-batches and measured
    peak (all ranks call it).

    Returns:
        One dict per rank, in rank order (on every rank).
    """
    mine = {
        "rank": ctx.rank,
        "blocks": checkpointed_blocks(unwrap(model)),
        "segments": applied_segments(unwrap(model)),
        "precision": precision,
        "micro_batches": micro_batches,
        "peak_bytes": peak_bytes,
    }
    if not ctx.active:
        return [mine]
    rows: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(rows, mine)
    return rows


def rank_notes(trainer: Any, ctx: DistContext, out: Path, budget: int | None) -> list[str]:
    """Under torchrun (every rank calls it): each rank's checkpointing, precision and peak,
    written by rank 0 to ``out/ranks.json``; returns the report's note."""
    if not ctx.active:
        return []
    peak = trainer.memory.peak_bytes if trainer.memory else None
    rows = gather_ranks(trainer.model, trainer.precision.mode, trainer.micro_batches, peak, ctx)
    if ctx.is_main:
        (out / "ranks.json").write_text(marked_json("ranks", {"budget_bytes": budget, "ranks": rows}))
    keys = ("blocks", "segments", "precision", "micro_batches")
    same = all(all(r[k] == rows[0][k] for k in keys) for r in rows)
    peaks = ", ".join(f"rank {r['rank']} {format_bytes(r['peak_bytes'] or 0)}" for r in rows)
    return [f"per-rank peaks: {peaks}; every rank ran {'the same' if same else 'a DIFFERENT'} plan"]
