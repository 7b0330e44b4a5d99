"""Planning a step that does not fit: what it costs, and whether the plan holds.

For each case, in a subprocess whose address space (``RLIMIT_AS``) leaves room for 60% of the
model's plain step beyond the model and its optimizer state (``tests/plan_rlimit_worker.py``):
``memfit.plan`` at 45% of the plain peak (or ``maximize="batch_size"`` at that budget), then
``memfit.prepare`` and three ``memfit.train_step``s there, and the plain step tried there (it
must fail). Then, unconstrained, in this process: the plan's peak measured with PyTorch's
tracking (``memfit.measure``) against its prediction, and planning's wall time as a multiple
of the plan's own step time, measured in the same subprocess.

Run (the Hugging Face case needs the extras environment):
    HF_HUB_OFFLINE=1 .venv-extras/bin/python benchmarks/bench_plan_room.py [--cases gpt-6x384 ...]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from room_helpers import measured_unconstrained, plain_peak, run_worker

from memfit.records import Plan

CASES = {
    "gpt-6x384": ("gpt-6x384", []),
    "gpt-6x384 largest batch": ("gpt-6x384", ["--maximize"]),
    "hf-llama": ("hf-llama", []),
}


def _row(name: str) -> str:
    model, extra = CASES[name]
    peak = plain_peak(model)
    result = run_worker("--model", model, "--peak", str(peak), *extra, *([] if extra else ["--try-plain"]))
    p = Plan.from_dict(result["plan"])
    measured = measured_unconstrained(model, p, batch_rows=p.batch_size if extra else None)
    step = statistics.median(result["step_seconds"])
    seconds = result["planning_seconds"]
    modes = ", ".join(f"{m} x{list(p.blocks.values()).count(m)}" for m in sorted(set(p.blocks.values())))
    losses = " -> ".join(f"{x:.2f}" for x in result["losses"])
    return (
        f"| {name} | {peak:,} | {p.budget_bytes:,} | {p.batch_size} | {modes}, {p.micro_batches} mb | "
        f"{p.predicted_peak_bytes:,} | {measured:,} | {measured / p.predicted_peak_bytes - 1:+.2%} | "
        f"{result['plain_fails']} | {seconds:.1f} s = {seconds / step:.1f} steps | {losses} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    print(
        f"{datetime.date.today()}, {platform.machine()} {torch.get_num_threads()}-thread torch "
        f"{torch.__version__}; room 60% of the plain step beyond model + optimizer state, budget 45%"
    )
    print(
        "| case | plain peak B | budget B | batch | plan | predicted B | measured B (unconstrained) | "
        "error | plain step fails there | planning | losses (3 steps there) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.cases:
        print(_row(name), flush=True)


if __name__ == "__main__":
    main()
