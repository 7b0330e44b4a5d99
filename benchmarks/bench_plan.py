"""Planner vs PyTorch's own checkpointing strategies at 50/65/80% of the fp32 baseline peak.

For each model, the planner's plans at the three budgets and PyTorch's strategies (full per
block, every 2nd block, ``checkpoint_sequential`` with sqrt(n) segments, selective) run in
one interleaved ``memfit.bench`` run. For each budget the table compares the plan's measured
step time with the fastest built-in strategy whose measured peak fits the same budget.

Run:  .venv/bin/python benchmarks/bench_plan.py [--steps 7]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import torch
from torch import nn

from memfit.benchmarking.planned import plan_strategy
from memfit.benchmarking.sweep import bench
from memfit.budget import format_bytes
from memfit.measuring.profile import profile
from memfit.planning.planner import plan
from memfit.records import BenchPoint
from memfit.train.gpt import GPT, GPTConfig, gpt_loss

BUILTIN = ["fp32/none", "fp32/full", "fp32/every2", "fp32/sequential", "fp32/selective"]
BUDGETS = (50, 65, 80)


class _Wide(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class UnevenNet(nn.Module):
    """Twelve residual MLP blocks of one class whose hidden widths differ 8x."""

    def __init__(self, width: int = 32, hidden: tuple[int, ...] = (32, 256, 64, 128) * 3):
        super().__init__()
        self.blocks = nn.ModuleList(_Wide(width, h) for h in hidden)
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _cases() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]]:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=6, n_embd=64, n_head=4, block_size=64))
    tokens = torch.randint(0, 256, (8, 65))
    uneven = UnevenNet()
    g = torch.Generator().manual_seed(1)
    vectors = (torch.randn(1024, 32, generator=g), torch.randn(1024, 1, generator=g))
    return {
        "built-in GPT (6 x 64, seq 64, batch 8)": (gpt, (tokens[:, :-1], tokens[:, 1:]), gpt_loss),
        "uneven MLP (12 blocks, width 32, hidden 32..256, batch 1024)": (uneven, vectors, _mse),
    }


def _row(budget: int, baseline: int, points: dict[str, BenchPoint], planned: dict[int, str]) -> list[str]:
    limit = int(baseline * budget / 100)
    fits = [points[n] for n in BUILTIN if points[n].ok and points[n].peak_bytes <= limit]
    best = min(fits, key=lambda p: p.step_seconds) if fits else None
    name = planned.get(budget)
    mine = points.get(name) if name else None
    if mine is None or not mine.ok:
        return [
            f"{budget}%",
            format_bytes(limit),
            "infeasible",
            "-",
            best.strategy if best else "none fits",
            "-",
        ]
    ratio = f"{mine.step_seconds / best.step_seconds:.2f}" if best else "(no built-in fits)"
    return [
        f"{budget}%",
        format_bytes(limit),
        f"{format_bytes(mine.peak_bytes)} ({'fits' if mine.peak_bytes <= limit else 'OVER'})",
        f"{mine.time_ratio:.2f}",
        f"{best.strategy} {format_bytes(best.peak_bytes)} {best.time_ratio:.2f}" if best else "none fits",
        ratio,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=7, help="timed steps per strategy, interleaved")
    parser.add_argument("--only", choices=("gpt", "uneven"), help="bench one model only")
    args = parser.parse_args()
    machine = platform.processor() or platform.machine()
    print(f"# {datetime.date.today()} on {machine}, torch {torch.__version__}")
    only = f" --only {args.only}" if args.only else ""
    print(f"# command: .venv/bin/python benchmarks/bench_plan.py --steps {args.steps}{only}\n")
    for title, (model, batch, loss_fn) in _cases().items():
        if args.only and not title.lower().startswith({"gpt": "built-in", "uneven": "uneven"}[args.only]):
            continue
        opt = torch.optim.AdamW(model.parameters())
        prof = profile(model, batch, loss_fn, opt, "fp32", repeats=3)
        strategies = []
        planned: dict[int, str] = {}
        notes = []
        for budget in BUDGETS:
            start = time.perf_counter()
            try:
                chosen = plan(model, batch, loss_fn, f"{budget}%", opt, "fp32", profiles={"fp32": prof})
            except Exception as exc:  # InfeasibleBudget: reported in the table
                notes.append(f"{budget}%: {exc}")
                continue
            took = time.perf_counter() - start
            modes = list(chosen.blocks.values())
            letters = " ".join(m[0].upper() for m in modes)
            notes.append(
                f"plan@{budget}%: {letters} (K keep, S selective, F full), micro-batches "
                f"{chosen.micro_batches}, predicted {format_bytes(chosen.predicted_peak_bytes)}, "
                f"measured {format_bytes(chosen.measured_peak_bytes)}, planned in {took:.1f} s"
            )
            planned[budget] = f"plan@{budget}%"
            strategies.append(plan_strategy(chosen, planned[budget]))
        points = bench(model, batch, loss_fn, opt, strategies=[*BUILTIN, *strategies], steps=args.steps)
        by_name = {p.strategy: p for p in points}
        base = by_name["fp32/none"]
        ms = base.step_seconds * 1e3
        print(f"## {title}: fp32/none peak {format_bytes(base.peak_bytes)}, {ms:.1f} ms/step\n")
        print(
            "| budget | bytes | plan peak | plan time (x none) | fastest fitting built-in: peak, time "
            "| plan / built-in |"
        )
        print("|---|---|---|---|---|---|")
        for budget in BUDGETS:
            print("| " + " | ".join(_row(budget, base.peak_bytes, by_name, planned)) + " |")
        print()
        for p in points:
            if p.strategy in BUILTIN:
                print(f"- {p.strategy}: peak {format_bytes(p.peak_bytes)}, time x{p.time_ratio:.2f}")
        for n in notes:
            print(f"- {n}")
        print()


if __name__ == "__main__":
    main()
