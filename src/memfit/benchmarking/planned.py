"""Planner points for ``memfit.bench``: one ``plan@BUDGET`` strategy per budget.

Each budget is planned once on the user's model (profiles shared across budgets); the
strategy applies that plan to the bench's fresh model copy and runs it at the plan's
precision and micro-batch count, side by side with PyTorch's own strategies.

Trade-off: planning costs a profile per precision and one measured step per budget before
the bench starts, so the planner's points cost a little more set-up than the built-in ones.

Example:
    >>> import torch
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> x = torch.randint(0, 256, (4, 16))
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> [s.name for s in planner_strategies(model, (x, x), gpt_loss, opt, ["80%"], "fp32")]
    ['plan@80%']
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from memfit.applying import apply
from memfit.benchmarking.strategies import Strategy
from memfit.devices import model_device
from memfit.errors import InfeasibleBudget
from memfit.measuring.profile import profile
from memfit.planning.choose import candidate_precisions
from memfit.planning.planner import plan
from memfit.records import Plan, Profile
from memfit.step import Batch, LossFn
from memfit.vocab import PrecisionName, normalize_precision

__all__ = ["plan_strategy", "planner_strategies"]


def _apply(chosen: Plan, model: nn.Module, batch: Batch, loss_fn: LossFn) -> nn.Module:
    return apply(model, chosen).model


def plan_strategy(chosen: Plan, name: str) -> Strategy:
    """A bench strategy that runs ``chosen`` (its checkpointing, precision and micro-batches)."""
    return Strategy(
        name=name,
        precision=cast(PrecisionName, normalize_precision(chosen.precision)),
        checkpointing="plan",
        prepare=functools.partial(_apply, chosen),
        micro_batches=chosen.micro_batches,
    )


def planner_strategies(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    budgets: Sequence[str | int],
    precision: str | Sequence[str] = "auto",
) -> list[Strategy]:
    """Plan ``model`` at each budget and return one ``plan@BUDGET`` strategy per feasible budget.

    Args:
        model: the model the bench runs (left as it was).
        batch: the bench's batch.
        loss_fn: ``loss_fn(model, batch) -> loss``.
        optimizer: the optimizer whose state counts in the budget.
        budgets: e.g. ``["50%", "65%", "80%"]`` or byte counts.
        precision: what the planner may choose from (as :func:`memfit.plan`).

    Returns:
        Strategies in the order of ``budgets``; a budget nothing fits is skipped with a
        warning printed by the caller (the InfeasibleBudget message is in ``.skipped``).
    """
    wanted = candidate_precisions(precision, model_device(model))
    profiles: dict[str, Profile] = {
        p: profile(model, batch, loss_fn, optimizer, p, repeats=1) for p in wanted
    }
    out: list[Strategy] = []
    for budget in budgets:
        try:
            chosen = plan(model, batch, loss_fn, budget, optimizer, wanted, profiles=profiles)
        except InfeasibleBudget:
            continue
        out.append(plan_strategy(chosen, f"plan@{budget}"))
    return out
