"""What planning costs: ``memfit.plan``'s seconds against one plain step of the same model.

Issue 36's goal: planning within 30 of the plan's steps or 3 s, whichever is larger, and a
refusal (a budget nothing meets) within 20 steps. For each model (the README's GPT 4 x 128
at batch 8 x 128, a 12 x 256 GPT, a Hugging Face Llama from its config where transformers
is installed, a ResNet-18-style CNN; ``pressure_models.py``): the median of ``--steps``
plain fp32 AdamW steps after a warm-up, then ``--calls`` plans at ``--budget`` (each
checked: the chosen plan measured once, as ``memfit.plan`` does by default), then a refusal
at ``--refuse`` of the plain peak; the plain steps are timed again after them and the two
medians averaged, and the last plan's step is timed (``memfit.train_step`` on a prepared
copy of the model). Each plan's ``planning_seconds`` (``memfit.plan`` measures its own wall
time) is weighed against both steps: the plan's (the issue's yardstick) and the plain one
(the stricter wherever the plan runs slower). Also reported: whether every call gave one
plan, and where the time went (the plan's ``measured`` lines). ``--busy`` runs every call
while each core spins in another process (``tests/busy_machine.py``), as the plan-repeat
test does, the steps timed so too. Steps are timed on torch's threads and, where other
processes keep cores busy, on the threads planning times on (Note [timing on the free
cores]); the faster of the two is the step the goal counts.

Run:
    .venv/bin/python benchmarks/bench_planning_cost.py                       # all models
    .venv/bin/python benchmarks/bench_planning_cost.py --model gpt-readme --budget 0.6 --calls 5 --busy
    HF_HUB_OFFLINE=1 .venv-extras/bin/python benchmarks/bench_planning_cost.py --model hf-llama
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from pressure_models import NAMES, Case, build

import memfit
from memfit.measuring.speed import timing_threads, torch_threads

#: Planning should cost at most this many plain steps, or this many seconds.
GOAL_STEPS, GOAL_SECONDS, REFUSAL_STEPS = 30.0, 3.0, 20.0


def _median(step: Callable[[], object], steps: int) -> float:
    """The median seconds of ``steps`` calls of ``step`` after one more (a warm-up)."""
    times = []
    for k in range(steps + 1):
        started = time.perf_counter()
        step()
        if k:  # the first is a warm-up
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def _on_both_threads(step: Callable[[], object], steps: int) -> tuple[float, float]:
    """:func:`_median` on torch's own threads, and on the threads planning times on (fewer
    where other processes keep cores busy: Note [timing on the free cores])."""
    threads, _ = timing_threads(torch.device("cpu"))
    own = _median(step, steps)
    if threads == torch.get_num_threads():
        return own, own
    with torch_threads(threads):
        return own, _median(step, steps)


def _plain_steps(case: Case, steps: int) -> tuple[float, float]:
    """The plain fp32 step, on torch's threads and on the planning threads."""

    def plain() -> None:
        case.optimizer.zero_grad(set_to_none=True)
        case.loss_fn(case.model, case.batch).backward()
        case.optimizer.step()

    both = _on_both_threads(plain, steps)
    case.optimizer.zero_grad(set_to_none=True)
    return both


def _plan_steps(case: Case, plan: memfit.Plan, steps: int) -> float:
    """The chosen plan's step (``memfit.train_step`` on a prepared copy of the model), the
    faster of torch's threads and the planning threads."""
    model, optimizer = copy.deepcopy((case.model, case.optimizer))
    model, optimizer = memfit.prepare(model, optimizer, plan)

    def planned() -> None:
        memfit.train_step(model, case.batch, case.loss_fn, optimizer, plan)

    return min(_on_both_threads(planned, steps))


def _busy(on: bool) -> contextlib.AbstractContextManager[object]:
    if not on:
        return contextlib.nullcontext()
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from busy_machine import busy_cores

    return busy_cores()


def _refusal(case: Case, fraction: float) -> tuple[float, str]:
    started = time.perf_counter()
    try:
        memfit.plan(case.model, case.batch, case.loss_fn, f"{fraction:.0%}", case.optimizer, "fp32")
    except memfit.InfeasibleBudget as exc:
        return time.perf_counter() - started, str(exc)[:120]
    return time.perf_counter() - started, "(a plan was found)"


def run(name: str, args: argparse.Namespace) -> None:
    case = build(name)
    plans, seconds = [], []
    with _busy(args.busy):  # the plain steps too: planning is weighed against steps on one machine
        before = _plain_steps(case, args.steps)
        for _ in range(args.calls):
            p = memfit.plan(
                case.model, case.batch, case.loss_fn, f"{args.budget:.0%}", case.optimizer, "fp32"
            )
            plans.append(json.dumps((p.blocks, p.segments, p.precision, p.micro_batches)))
            seconds.append(p.report.planning_seconds)
        refused, why = _refusal(case, args.refuse)
        after = _plain_steps(case, args.steps)
        planned = _plan_steps(case, p, args.steps)
    own, free = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
    step = min(own, free)  # the faster of the two: the stricter goal
    goal = max(GOAL_STEPS * step, GOAL_SECONDS)
    fewer = (
        f" (the faster of {own * 1e3:.1f} ms on torch's {torch.get_num_threads()} threads and "
        f"{free * 1e3:.1f} ms on the threads planning timed on)"
        if free != own
        else ""
    )
    print(
        f"\n## {name}: plain step {step * 1e3:.1f} ms{fewer}; goal {goal:.1f} s "
        f"(max of {GOAL_STEPS:.0f} steps, 3 s)"
    )
    plan_goal = max(GOAL_STEPS * planned, GOAL_SECONDS)
    print(
        f"the plan's step (the issue's yardstick: 30 of the plan's steps or 3 s) {planned * 1e3:.1f} ms, "
        f"{planned / step:.2f}x the plain step; goal {plan_goal:.1f} s"
    )
    print("\n| call | planning s | x plain step | within goal | x plan's step | within its goal |")
    print("|---:|---:|---:|---|---:|---|")
    for i, s in enumerate(seconds, start=1):
        print(
            f"| {i} | {s:.2f} | {s / step:.1f} | {'yes' if s <= goal else 'NO'} | {s / planned:.1f} "
            f"| {'yes' if s <= plan_goal else 'NO'} |"
        )
    verdict = "yes" if refused <= max(REFUSAL_STEPS * step, GOAL_SECONDS) else "NO"
    took = f"{refused:.2f} s ({refused / step:.1f} steps; within goal: {verdict})"
    print(f"\nrefusal at {args.refuse:.0%}: {took}")
    print(f"its message: {why}")
    print(
        f"one plan over {args.calls} calls{' on a busy machine' if args.busy else ''}: {len(set(plans)) == 1}"
    )
    print(f"last plan: {plans[-1]}\nwhere its time went:\n" + "\n".join(f"- {m}" for m in p.report.measured))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", choices=NAMES)
    ap.add_argument("--budget", type=float, default=0.6)
    ap.add_argument("--refuse", type=float, default=0.05)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--busy", action="store_true")
    args = ap.parse_args()
    when = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    print(f"# bench_planning_cost.py: {when}, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
    for name in args.model or ["gpt-readme", "gpt-12x256", "hf-llama", "resnet"]:
        try:
            run(name, args)
        except ImportError as exc:
            print(f"\n## {name}: skipped ({exc})")


if __name__ == "__main__":
    main()
