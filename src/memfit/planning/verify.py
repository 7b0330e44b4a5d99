"""``memfit.plan(..., verify=True)``: refuse a lever whose check fails on the user's model.

The chosen lever set is checked as ``memfit check`` does (:func:`memfit.check_stability`):
fp32 AdamW (the user's optimizer as it is), a second fp32 run for the noise band, and a
run with the levers, all from the same weights, on the planning batch. If that run FAILs,
each lever is checked alone and those that fail are refused (the planner then plans again
without them).

Trade-off: the check costs ``3 * VERIFY_STEPS`` training steps (more when a lever fails),
paid once at planning; it runs on the one batch planning was given, so it proves the
levers follow fp32 on this model, not on the whole data set (``memfit check`` does that).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable

import torch
from torch import nn

from memfit.check.stability import check_stability
from memfit.devices import model_device
from memfit.records import Plan
from memfit.step import Batch, LossFn

__all__ = ["VERIFY_STEPS", "failing_levers"]

#: Training steps of each run of the verification check.
VERIFY_STEPS = 20


def _optimizer_fn(optimizer: torch.optim.Optimizer | None) -> object:
    cls: type[torch.optim.Optimizer] = type(optimizer) if optimizer is not None else torch.optim.AdamW
    defaults = dict(optimizer.defaults) if optimizer is not None else {}
    takes = inspect.signature(cls.__init__).parameters

    def make(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return cls(params, **{k: v for k, v in defaults.items() if k in takes})

    return make


def failing_levers(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    plan: Plan,
    measured: list[str],
    steps: int = VERIFY_STEPS,
) -> dict[str, str]:
    """``{lever: why}`` for the levers of ``plan`` whose check fails on ``model`` (empty: none).

    ``measured`` receives one line per check run.
    """
    initial = copy.deepcopy(model)
    device = model_device(model)

    def check(levers: list[str]) -> tuple[str, list[str]]:
        report = check_stability(
            lambda: copy.deepcopy(initial),
            [batch],
            loss_fn,
            _optimizer_fn(optimizer),  # type: ignore[arg-type]
            (plan.precision,),
            steps,
            device=device,
            levers=levers,
        )
        pc = report.by_precision[plan.precision]
        measured.append(
            f"verify: levers {', '.join(levers)} at {plan.precision}, {steps} steps: {pc.verdict}"
        )
        return pc.verdict, pc.reasons

    verdict, _ = check(list(plan.levers))
    if verdict != "FAIL":
        return {}
    failed = {}
    for lever in plan.levers:
        verdict, reasons = check([lever])
        if verdict == "FAIL":
            failed[lever] = f"its check against fp32 failed on this model ({'; '.join(reasons)})"
    if not failed:
        failed = {n: "the levers together failed their check against fp32" for n in plan.levers}
    return failed
