"""Run by ``test_plan_room.py`` (and ``benchmarks/bench_plan_room.py``) in a subprocess: plan a
step that does not fit.

Builds a model and its AdamW state, then lowers the process's address-space limit
(``RLIMIT_AS``) to what is in use now plus ``--room`` times the plain step's peak (measured
by the caller, unconstrained), plans at ``--budget`` times that peak, applies the plan with
``memfit.prepare`` and trains three ``memfit.train_step``s under the limit. Prints one
``RESULT {json}`` line: the plan, its prediction, the losses, whether the plain step fails
under the limit (``--try-plain``), and what the planner measured.

Warmed up as a user would be (issue 36): one ordinary training step on a batch of one creates
the optimizer's state before the limit; nothing else runs first (what planning's fake-tensor
step loads, it loads under the limit). The environment need not tune glibc's malloc: memfit
does what ``MALLOC_MMAP_THRESHOLD_`` would where ``RLIMIT_AS`` is the tightest limit (See Note
[address space under RLIMIT_AS] in memfit/devices.py).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from models_for_room import build
from rlimit import limit_address_space

import memfit
from memfit.applying.apply_plan import remove_levers
from memfit.errors import MemfitError, is_out_of_memory
from memfit.planning.largest_batch import resize_batch
from memfit.precision import Precision
from memfit.step import training_step


def _plain_fails(model: torch.nn.Module, batch: Any, loss_fn: Any, opt: torch.optim.Optimizer) -> bool:
    try:
        training_step(model, batch, loss_fn, opt, Precision("fp32"))
    except Exception as exc:
        if is_out_of_memory(exc):
            return True
        raise
    return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--peak", type=int, required=True, help="the plain step's peak, measured unconstrained"
    )
    parser.add_argument("--room", type=float, default=0.60)
    parser.add_argument("--budget", type=float, default=0.45)
    parser.add_argument("--maximize", action="store_true")
    parser.add_argument("--levers", default="", help="levers the plan may use, comma-separated")
    parser.add_argument("--try-plain", action="store_true")
    parser.add_argument("--bench", action="store_true", help="bench fp32/none and fp32/full instead")
    parser.add_argument("--expect-error", action="store_true", help="print memfit's refusal as ERROR")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, batch, loss_fn = build(args.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn(model, resize_batch(batch, 1)).backward()  # one ordinary step, as a user's first
    opt.step()
    opt.zero_grad(set_to_none=True)
    limit_address_space(int(args.room * args.peak))
    if args.bench:
        points = memfit.bench(model, batch, loss_fn, opt, strategies=["fp32/none", "fp32/full"], steps=1)
        print("RESULT " + json.dumps({"points": [p.to_dict() for p in points]}))
        return
    started = time.perf_counter()
    budget = int(args.budget * args.peak)
    maximize = "batch_size" if args.maximize else None
    try:
        levers = [n for n in args.levers.split(",") if n] or None
        p = memfit.plan(model, batch, loss_fn, budget, opt, "fp32", maximize=maximize, levers=levers)
    except MemfitError as exc:
        if not args.expect_error:
            raise
        print("RESULT " + json.dumps({"error": str(exc), "kind": type(exc).__name__}))
        return
    seconds = time.perf_counter() - started
    if maximize:
        batch = resize_batch(batch, p.batch_size)
    model, opt = memfit.prepare(model, opt, p)
    steps = []
    for _ in range(3):
        t0 = time.perf_counter()
        steps.append((memfit.train_step(model, batch, loss_fn, opt, p), time.perf_counter() - t0))
    if args.try_plain:  # the plain step: no checkpointing, no levers
        memfit.uncheckpoint(model)
        remove_levers(model, opt)
    plain_fails = _plain_fails(model, batch, loss_fn, opt) if args.try_plain else None
    result = {
        "plan": p.to_dict(),
        "planning_seconds": seconds,
        "losses": [float(loss) for loss, _ in steps],
        "step_seconds": [s for _, s in steps],
        "plain_fails": plain_fails,
        "budget_bytes": budget,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
