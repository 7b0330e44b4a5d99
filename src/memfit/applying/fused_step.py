"""The ``fused_step`` lever: the optimizer step inside the backward (:mod:`memfit.levers.fused`).

Exact (the same weights as the step after the backward): gradients are freed as each
parameter steps, so they are never all alive; each part's backward holds instead its
largest parameter's gradient and step temporaries. With clipping the last micro-batch's
backward runs twice (not in the predicted time). fp16's loss scaling must see every
gradient before any step: refused there.

Example:
    >>> FUSED_STEP.refusal(Site(torch.device("cpu"), "none", "fp32"))[:40]
    'fused_step steps the optimizer inside th'
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.applying.lever import Applying, Lever, Predict, Predicting, Site
from memfit.levers.fused import FusedStep, fused_step_of
from memfit.precision import PRECISION_KINDS
from memfit.records import Plan, Profile
from memfit.stepmodel.state_bytes import step_slice_numel, temp_key

__all__ = ["FUSED_STEP", "FusedStepLever"]


class FusedStepLever(Lever):
    """The optimizer step fused into the backward."""

    name = "fused_step"
    order = 90  # last: it hooks the optimizer the other levers made
    needs_optimizer = True

    def refusal(self, site: Site) -> str | None:
        if site.optimizer == "none":
            return "fused_step steps the optimizer inside the backward; pass the optimizer training uses."
        kind = PRECISION_KINDS.get(site.precision)
        if kind is not None and kind.loss_scaled:
            return (
                "fused_step steps each parameter inside the backward, before fp16 loss scaling could check "
                "every gradient for overflow; use bf16 (no loss scaling) or leave fused_step out."
            )
        return None

    def predict(self, out: Profile, ctx: Predicting) -> None:
        facts, kind = ctx.facts, ctx.optimizer_kind
        per = facts.step_temp_per_element.get(temp_key(kind, ctx.weights), 0.0)
        out.lever_step_bytes = {
            part: max(
                (
                    n * ctx.weight_bytes + round(per * step_slice_numel(n, kind, facts.step_eager))
                    for n in numels
                ),
                default=0,
            )
            for part, numels in facts.params.items()
        }

    def note(self, plan: Plan, profile: Profile, with_levers: Predict) -> str | None:
        return (
            "fused_step: with clip_norm the last micro-batch's backward runs twice (norms first, then the "
            "steps), which the predicted step time does not include; without clipping it adds no work."
        )

    def clear(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        old = fused_step_of(optimizer)
        if old is not None:
            old.remove()

    def apply(self, optimizer: torch.optim.Optimizer | None, ctx: Applying) -> torch.optim.Optimizer | None:
        assert optimizer is not None  # needs_optimizer: refused before
        fused = FusedStep(optimizer)
        if ctx.undo is not None:
            ctx.undo.add(fused.remove)
        return optimizer


FUSED_STEP = FusedStepLever()
