"""Does the time model choose the fastest plan? Every plan memfit weighed, timed side by side.

Issue 36's two cases: the ResNet-18-style CNN (batch 64 x 3 x 128 x 128) at 35% of its plain
fp32 peak, where memfit once chose 64 micro-batches of one image (predicted 0.96x the plain
step, measured 2.16x), and the GPT 6 x 384 with a vocabulary of 8192 (batch 16 x 256) at 70%,
where it chose a whole-batch plan measured at 1.15x while 4 micro-batches measured 1.05x.

For each case: ``memfit.plan`` at the budget (fp32, AdamW), its profiles kept; then every plan
the chooser weighed (:func:`memfit.planning.choose.considered`: each micro-batch count's fastest
of the solver's and PyTorch's own configurations that fit) and the plain step are timed in
interleaved rounds (one step each per round, after a warm-up round), medians reported. Checks
printed: the chosen plan's median within 15% of its prediction, and no plan weighed measuring
faster than the chosen one by more than the rounds' spread. Timing is never asserted in tests:
run this on a quiet machine and copy its output into RESULTS.md.

Run:
    .venv/bin/python benchmarks/bench_time_model.py                      # both cases
    .venv/bin/python benchmarks/bench_time_model.py --case gpt --rounds 5
    .venv/bin/python benchmarks/bench_time_model.py --case resnet-small --budget 0.35   # a quick check
    .venv/bin/python benchmarks/bench_time_model.py --case gpt-readme --budget 0.6
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch
from pressure_models import NAMES, Case, build

import memfit
from memfit.checkpointing import uncheckpoint
from memfit.planning.choose import considered
from memfit.precision import Precision
from memfit.records import Plan, Profile
from memfit.step import training_step

#: The chosen plan's measured time must be within this fraction of its prediction.
WITHIN = 0.15
#: The cases: (model, budget as a fraction of the plain fp32 peak).
CASES = {"resnet": ("resnet", 0.35), "gpt": ("gpt-6x384-v8k", 0.70)}


def _label(plan: Plan) -> str:
    modes = list(plan.blocks.values())
    kinds = ", ".join(f"{m} x{modes.count(m)}" for m in ("none", "selective", "full") if modes.count(m))
    segs = f", {len(plan.segments)} segment(s)" if plan.segments else ""
    return f"{kinds}{segs}, {plan.micro_batches} micro-batch(es)"


def _one_step(case: Case, plan: Plan | None) -> float:
    uncheckpoint(case.model)
    if plan is not None:
        memfit.apply(case.model, plan)
    micro, prec = (plan.micro_batches, plan.precision) if plan is not None else (1, "fp32")
    started = time.perf_counter()
    training_step(case.model, case.batch, case.loss_fn, case.optimizer, Precision(prec), micro)
    return time.perf_counter() - started


def _timed(case: Case, plans: list[Plan | None], rounds: int) -> list[list[float]]:
    """Seconds of one step of each plan per round, the plans interleaved (round 0 warms up)."""
    times: list[list[float]] = [[] for _ in plans]
    for r in range(rounds + 1):
        for i, plan in enumerate(plans):
            took = _one_step(case, plan)
            if r:
                times[i].append(took)
    uncheckpoint(case.model)
    return times


def _spread(ts: list[float]) -> float:
    mid = statistics.median(ts)
    return (max(ts) - min(ts)) / (2 * mid) if mid > 0 and len(ts) > 1 else 0.0


def _plans(name: str, model: str, budget: float) -> tuple[Case, Plan, list[Plan], float]:
    """The case, memfit's plan at ``budget`` of the plain peak, every plan it weighed, and the
    planning seconds."""
    case = build(model)
    base = memfit.measure(case.model, case.batch, case.loss_fn, case.optimizer, steps=1).peak_bytes
    profiles: dict[str, Profile] = {}
    started = time.perf_counter()
    chosen = memfit.plan(
        case.model, case.batch, case.loss_fn, int(budget * base), case.optimizer, "fp32", profiles=profiles
    )
    planning = time.perf_counter() - started
    print(f"\n## {name}: {model} at {budget:.0%} of its plain fp32 peak ({base:,} B)")
    weighed = considered(
        profiles, chosen.budget_bytes, chosen.report.baseline_peak_bytes, chosen.report.baseline_step_seconds
    )
    return case, chosen, weighed, planning


def _row(plan: Plan, ts: list[float], plain: float, chosen: bool) -> str:
    med = statistics.median(ts)
    mark = " **chosen**" if chosen else ""
    predicted = plan.report.predicted_step_seconds
    return (
        f"| {_label(plan)}{mark} | {plan.predicted_peak_bytes:,} | {predicted:.3f} | "
        f"{med:.3f} ±{_spread(ts):.0%} | {med / predicted:.2f} | {med / plain:.2f} |"
    )


def _verdicts(plans: list[Plan], times: list[list[float]]) -> None:
    """Whether the chosen plan (first) is within :data:`WITHIN` of its prediction, and whether a
    plan weighed measured faster by more than both plans' rounds spread."""
    chosen, mine = plans[0], statistics.median(times[0])
    off = abs(mine - chosen.report.predicted_step_seconds) / chosen.report.predicted_step_seconds
    print(f"\nchosen plan measured within {off:.1%} of its prediction: {'yes' if off <= WITHIN else 'NO'}")
    slack = 1 + _spread(times[0])
    faster = [
        i for i in range(1, len(plans)) if statistics.median(times[i]) * (slack + _spread(times[i])) < mine
    ]
    for i in faster:
        ratio = statistics.median(times[i]) / mine
        print(f"FASTER than the chosen plan beyond the rounds' spread: {_label(plans[i])} at {ratio:.2f}x")
    if not faster:
        print("no plan weighed measured faster than the chosen one beyond the rounds' spread: yes")


def run_case(name: str, model: str, budget: float, rounds: int, most: int) -> None:
    case, chosen, weighed, planning = _plans(name, model, budget)
    key = (chosen.blocks, chosen.segments, chosen.micro_batches)
    rest = [p for p in weighed if (p.blocks, p.segments, p.micro_batches) != key][: most - 1]
    times = _timed(case, [None, chosen, *rest], rounds)
    plain = statistics.median(times[0])
    print(
        f"budget {chosen.budget_bytes:,} B; planning {planning:.1f} s ({planning / plain:.0f} plain steps); "
        f"plain step {plain * 1e3:.1f} ms (spread ±{_spread(times[0]):.0%}); {len(weighed)} plans weighed, "
        f"{1 + len(rest)} timed, {rounds} rounds"
    )
    print(
        "\n| plan | peak predicted (B) | predicted s | measured s (median) | measured / predicted | x plain |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for i, plan in enumerate([chosen, *rest]):
        print(_row(plan, times[i + 1], plain, i == 0))
    _verdicts([chosen, *rest], times[1:])
    print(f"chosen: {_label(chosen)}; its notes: {chosen.notes[1] if len(chosen.notes) > 1 else ''}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--case", choices=[*CASES, *NAMES], action="append", help="a case, or a model of pressure_models"
    )
    ap.add_argument("--budget", type=float, help="override the case's budget (fraction of the plain peak)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--most", type=int, default=12, help="the most plans timed (the chosen one first)")
    args = ap.parse_args()
    when = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    print(f"# bench_time_model.py: {when}, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
    for name in args.case or list(CASES):
        model, budget = CASES.get(name, (name, 0.35))
        run_case(name, model, args.budget or budget, args.rounds, args.most)


if __name__ == "__main__":
    main()
