"""Helpers of the room tests: run a worker under ``RLIMIT_AS``, measure a plan unconstrained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from models_for_room import build

import memfit
from memfit.records import Plan

__all__ = [
    "assert_planned_under_the_limit",
    "linux_only",
    "measured_unconstrained",
    "plain_peak",
    "run_worker",
    "worker_env",
]

#: How far the plan measured unconstrained may be from its prediction.
PREDICTION_RTOL = 0.05
linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's"
)


def worker_env() -> dict[str, str]:
    """The environment of a worker under ``RLIMIT_AS``: one thread, glibc's malloc as a user
    has it (memfit maps large blocks itself under the limit: See Note [address space under
    RLIMIT_AS] in memfit/devices.py)."""
    here = Path(__file__).parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
    }
    for tuned in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX"):
        env.pop(tuned, None)
    return env


def run_worker(*args: str, timeout: int = 900) -> dict[str, Any]:
    """Run ``plan_rlimit_worker.py`` with ``args`` and return its RESULT."""
    worker = Path(__file__).parent / "plan_rlimit_worker.py"
    done = subprocess.run(
        [sys.executable, str(worker), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=worker_env(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line[len("RESULT ") :])
    return result


def plain_peak(name: str) -> int:
    model, batch, loss_fn = build(name)
    return memfit.measure(model, batch, loss_fn, torch.optim.AdamW(model.parameters())).peak_bytes


def measured_unconstrained(name: str, plan: Plan, batch_rows: int | None = None) -> int:
    """The plan's peak measured with PyTorch's tracking in this (unconstrained) process."""
    from memfit.planning.largest_batch import resize_batch

    model, batch, loss_fn = build(name)
    if batch_rows is not None:
        batch = resize_batch(batch, batch_rows)
    opt = torch.optim.AdamW(model.parameters())
    memfit.apply(model, plan)
    return memfit.measure(
        model, batch, loss_fn, opt, precision=plan.precision, micro_batches=plan.micro_batches
    ).peak_bytes


def assert_planned_under_the_limit(name: str, result: dict[str, Any]) -> None:
    p = Plan.from_dict(result["plan"])
    assert result["plain_fails"] is True, "the plain step must not fit under the limit"
    assert p.predicted_peak_bytes <= p.budget_bytes == result["budget_bytes"]
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert result["losses"][-1] < result["losses"][0]
    assert any("fake-tensor twin" in n and "RLIMIT_AS" in n for n in p.notes), p.notes
    assert p.report.baseline_from == "fake tensors"
    assert any("does not fit" in m for m in p.report.measured), p.report.measured
    measured = measured_unconstrained(name, p)
    assert measured <= p.budget_bytes
    assert abs(measured - p.predicted_peak_bytes) <= PREDICTION_RTOL * p.predicted_peak_bytes
