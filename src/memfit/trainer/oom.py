"""Out of memory in a training step: put the step back, re-plan with less memory, run it again.

When a step raises an out-of-memory error (``torch.OutOfMemoryError`` on CUDA, the CPU
allocator's "can't allocate memory" under a process memory limit), the Trainer:

1. checks that the step had not yet touched the weights or the optimizer state (it runs
   out in the forward or backward pass, where activations live; an optimizer step that
   ran out half-way cannot be undone, and that is said instead);
2. re-plans with :func:`memfit.plan` under the peak of the configuration that failed,
   less a margin (on CUDA the allocator's peak when it failed; elsewhere the peak last
   measured or predicted for the plan), reusing the plan's profiles when it has them;
3. applies the new plan, puts back the random generators and running statistics the
   failed attempt changed, and runs the same batch again.

No step is lost and none is done twice: the failed attempt changed nothing that the retry
sees, so training continues exactly as if it had used the new plan from that step on.

Trade-off: the Trainer keeps, per step, a copy of the random-generator states and of the
normalisation layers' running statistics (a few KiB), and reads the version counters of
parameters and optimizer state; a re-plan costs a profile when no profile is cached.

Example:
    >>> describe_plan(Plan(blocks={"blocks.0": "full", "blocks.1": "keep"}))
    '1 full, 1 keep; 1 micro-batch(es)'
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from memfit.budget import format_bytes
from memfit.devices import model_device
from memfit.errors import ConfigError
from memfit.records import Plan, Profile
from memfit.report.table import mode_counts
from memfit.trainer.state import capture_rng, restore_rng
from memfit.vocab import CheckpointMode, PrecisionName

__all__ = [
    "OomConfig",
    "ReplanEvent",
    "StepSnapshot",
    "describe_plan",
    "failed_peak",
    "refusal",
    "replan",
]

log = logging.getLogger("memfit.oom")


@dataclass(kw_only=True)
class OomConfig:
    """What the Trainer does when a step runs out of memory."""

    replan: bool = True
    """Re-plan and retry the step; False: raise :class:`memfit.errors.OutOfMemory` at once."""
    margin: float = 0.1
    """The new plan's budget is the failed peak times ``1 - margin``."""
    max_replans: int = 3
    """Re-plans for one step before giving up."""
    profiles: dict[str, Profile] = field(default_factory=dict)
    """Profiles by precision to re-plan from (filled by the first re-plan if empty)."""

    def __post_init__(self) -> None:
        if not 0 < self.margin < 1:
            raise ConfigError(f"the out-of-memory margin must be between 0 and 1, got {self.margin}.")
        if self.max_replans < 1:
            raise ConfigError(f"max_replans must be at least 1, got {self.max_replans}.")


@dataclass
class ReplanEvent:
    """One re-plan after an out-of-memory step."""

    step: int
    error: str
    """The first line of the out-of-memory error."""
    failed_peak_bytes: int
    budget_bytes: int
    before: str
    after: str
    plan: Plan

    @property
    def message(self) -> str:
        """One sentence for logs and reports."""
        return (
            f"step {self.step} ran out of memory ({self.error}); re-planned under "
            f"{format_bytes(self.budget_bytes)} ({format_bytes(self.failed_peak_bytes)} less the margin): "
            f"{self.before} -> {self.after}; the step was run again"
        )


def describe_plan(plan: Plan | None, micro_batches: int = 1) -> str:
    """``"2 full, 1 keep; 1 micro-batch(es)"``: block modes counted, and micro-batches."""
    if plan is None:
        return f"no plan; {micro_batches} micro-batch(es)"
    counts = mode_counts(plan.blocks.values())
    modes = ", ".join(f"{n} {m}" for m, n in sorted(counts.items())) or "no blocks"
    return f"{modes}; {plan.micro_batches} micro-batch(es)"


def _norm_buffers(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Running statistics are the buffers a forward pass changes in training mode.
    kept = []
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            kept += [(b, b.detach().clone()) for b in m.buffers(recurse=False)]
    return kept


def _versions(tensors: list[torch.Tensor]) -> list[int]:
    return [t._version for t in tensors]


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@dataclass
class StepSnapshot:
    """What a step may change before its optimizer step, taken before the step."""

    rng: dict[str, Any]
    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    other_buffers: list[torch.Tensor]
    other_versions: list[int]
    params: list[torch.Tensor]
    param_versions: list[int]
    optimizer_entries: int
    optimizer_versions: list[int]

    @classmethod
    def take(cls, model: nn.Module, optimizer: torch.optim.Optimizer) -> StepSnapshot:
        """Snapshot ``model`` and ``optimizer`` (cheap: RNG states, running statistics, versions)."""
        buffers = _norm_buffers(model)
        kept = {id(b) for b, _ in buffers}
        others = [b for b in model.buffers() if id(b) not in kept]
        params: list[torch.Tensor] = list(model.parameters())
        return cls(
            rng=capture_rng(),
            buffers=buffers,
            other_buffers=others,
            other_versions=_versions(others),
            params=params,
            param_versions=_versions(params),
            optimizer_entries=len(optimizer.state),
            optimizer_versions=_versions(_optimizer_tensors(optimizer)),
        )

    def untouched(self, optimizer: torch.optim.Optimizer) -> str | None:
        """None when the weights, other buffers and optimizer state are as they were; else what changed."""
        if _versions(self.params) != self.param_versions:
            return "the weights were partly updated"
        if (
            len(optimizer.state) != self.optimizer_entries
            or _versions(_optimizer_tensors(optimizer)) != self.optimizer_versions
        ):
            return "the optimizer state was partly updated"
        if _versions(self.other_buffers) != self.other_versions:
            return "a buffer of the model was changed in place"
        return None

    def restore(self) -> None:
        """Put back the random generators and running statistics as they were before the step."""
        with torch.no_grad():
            for live, saved in self.buffers:
                live.copy_(saved)
        restore_rng(self.rng)


def failed_peak(
    device: torch.device,
    plan: Plan | None,
    last_tracked: int | None,
    profiles: Mapping[str, Profile],
    precision: PrecisionName,
    modes: Mapping[str, CheckpointMode],
    micro_batches: int,
) -> int:
    """The peak of the configuration that ran out of memory, as well as it is known.

    CUDA: the allocator's peak since the step started (what fitted before the failing
    allocation). Elsewhere: the peak last measured with this configuration, else the
    plan's measured or predicted peak, else the profile's prediction for these modes.
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if last_tracked:
        return int(last_tracked)
    if plan is not None and (plan.measured_peak_bytes or plan.predicted_peak_bytes):
        return int(plan.measured_peak_bytes or plan.predicted_peak_bytes)
    from memfit.stepmodel import simulate

    profile = profiles[precision]
    named = {b.name: modes.get(b.name, "none") for b in profile.blocks}
    return int(simulate(profile, named, micro_batches).peak_bytes)


def refusal(config: OomConfig, distributed: bool, attempt: int) -> str | None:
    """Why a step that ran out of memory is not re-planned, or None when it is."""
    if not config.replan:
        return "re-planning is off (OomConfig(replan=False))"
    if distributed:
        return "re-planning is not supported under torchrun (every rank must run one plan)"
    if attempt >= config.max_replans:
        return f"it still did after {attempt} re-plan(s)"
    return None


def replan(
    model: nn.Module,
    batch: Any,
    loss_fn: Any,
    optimizer: torch.optim.Optimizer,
    precision: PrecisionName,
    plan: Plan | None,
    micro_batches: int,
    last_tracked: int | None,
    config: OomConfig,
) -> tuple[Plan, int, int]:
    """The plan for the failed peak less the margin; returns (plan, failed peak, budget).

    Profiles the model at ``precision`` first when ``config.profiles`` has no profile for it.

    Raises:
        InfeasibleBudget: no plan fits the smaller budget.
    """
    # Note [re-planning from the profiles alone]
    # The new plan comes from the profiles alone (no measured check, which would need memory):
    # the retried step is its check, and a plan that still runs out is re-planned again under
    # its own peak.
    from memfit.checkpointing import checkpointed_blocks
    from memfit.planning.choose import plan_from_profiles

    if precision not in config.profiles:
        from memfit.measuring.profile import profile

        config.profiles[precision] = profile(model, batch, loss_fn, optimizer, precision)
    device = model_device(model)
    modes = checkpointed_blocks(model)
    peak = failed_peak(device, plan, last_tracked, config.profiles, precision, modes, micro_batches)
    budget = max(1, int(peak * (1 - config.margin)))
    new = plan_from_profiles(
        {precision: config.profiles[precision]},
        budget,
        plan.report.baseline_peak_bytes if plan else 0,
        plan.report.baseline_step_seconds if plan else 0.0,
    )
    # made for the same model, batch and device as the plan it replaces
    return (replace(new, made_for=plan.made_for) if plan else new), peak, budget
