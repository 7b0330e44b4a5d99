"""The built-in GPT (6 x 384, sequence 256, batch 8, AdamW) planned with ``levers="all"`` for
0.25x of its fp32 peak without checkpointing, torchao's step run eagerly (issue 25).

For each precision choice (``auto``: what ``memfit.plan`` picks by default on this machine,
and ``bf16``), the plan is made, applied with ``memfit.prepare``, and its second step
(optimizer state made) measured with PyTorch's MemTracker around ``memfit.train_step``; or
the refusal is printed. Then the fp32 lever plans the step model ranks smallest are measured
one by one, to show whether an fp32 refusal is true.

Run (about 3 minutes on a 2-core CPU): ``TORCHDYNAMO_DISABLE=1 .venv/bin/python
benchmarks/bench_lowbit_plan.py`` (the variable is set when absent: torchao's compiled step
runs eagerly, as MemTracker sees it, and is priced so).
"""

from __future__ import annotations

import os
import platform

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch

import memfit
from memfit.applying import with_levers
from memfit.measuring.memory import measure
from memfit.measuring.tracker import MemoryWatch
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.planning import planner
from memfit.planning.lever_sets import levers_applied
from memfit.precision import Precision
from memfit.records import Plan, Profile
from memfit.step import training_step
from memfit.stepmodel import simulate

FP32_SETS = (
    ["state_4bit", "chunked_loss"],
    ["fused_step", "state_4bit", "chunked_loss"],
    ["fused_step", "state_4bit"],
)


def _setup() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor], torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6, n_embd=384, n_head=6, block_size=256))
    x = torch.randint(0, 256, (8, 256))
    return model, (x, x), torch.optim.AdamW(model.parameters(), lr=1e-3)


def _planned(precision: str, budget: int, profiles: dict[str, Profile]) -> None:
    """Plan, prepare, measure the second step; print it (or the refusal)."""
    model, batch, opt = _setup()
    seen = planner.plan_with_levers

    def keep(profs, *args, **kwargs):  # type: ignore[no-untyped-def]
        profiles.update(profs)  # the profiles with lever facts, for the fp32 table
        return seen(profs, *args, **kwargs)

    planner.plan_with_levers = keep
    try:
        plan = memfit.plan(model, batch, gpt_loss, budget, opt, precision=precision, levers="all")  # type: ignore[arg-type]
    except memfit.InfeasibleBudget as exc:
        print(f"precision={precision}: refused: {exc}")
        return
    finally:
        planner.plan_with_levers = seen
    model, opt = memfit.prepare(model, opt, plan)
    memfit.train_step(model, batch, gpt_loss, opt, plan)
    with MemoryWatch(model, opt) as watch:
        memfit.train_step(model, batch, gpt_loss, opt, plan)
    modes = ", ".join(
        f"{m} x{list(plan.blocks.values()).count(m)}" for m in sorted(set(plan.blocks.values()))
    )
    print(
        f"precision={precision}: plan {plan.precision} {plan.levers} ({modes}; segments {plan.segments}; "
        f"{plan.micro_batches} micro-batches) predicted {plan.predicted_peak_bytes:,} B, MemTracker "
        f"{watch.peak_bytes:,} B ({plan.predicted_peak_bytes / watch.peak_bytes - 1:+.2%}), "
        f"{'fits' if watch.peak_bytes <= budget else 'OVER'} {budget:,} B"
    )


def _fp32_table(base: Profile, budget: int) -> None:
    """The fp32 lever plans (full checkpointing) the step model ranks smallest, measured."""
    model, batch, opt = _setup()
    rows = sorted(
        (simulate(with_levers(base, levers), "full", mb).peak_bytes, levers, mb)
        for levers in FP32_SETS
        for mb in (4, 8)
    )
    blocks = [b.name for b in base.blocks]
    for predicted, levers, mb in rows[:3]:
        plan = Plan(
            blocks=dict.fromkeys(blocks, "full"), precision="fp32", levers=list(levers), micro_batches=mb
        )
        memfit.apply(model, plan)
        with levers_applied(model, opt, plan) as used, MemoryWatch(model, used) as watch:
            training_step(model, batch, gpt_loss, used, Precision("fp32"), mb)
        memfit.uncheckpoint(model)
        print(
            f"  fp32 {levers} full x{mb}: predicted {predicted:,} B, MemTracker {watch.peak_bytes:,} B "
            f"({predicted / watch.peak_bytes - 1:+.2%}); {'fits' if watch.peak_bytes <= budget else 'over'}"
        )


def main() -> None:
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"TORCHDYNAMO_DISABLE={os.environ.get('TORCHDYNAMO_DISABLE')}")  # fmt: skip
    model, batch, opt = _setup()
    plain = measure(model, batch, gpt_loss, opt, "fp32", steps=1).peak_bytes
    budget = int(0.25 * plain)
    print(f"fp32 without checkpointing {plain:,} B; budget 0.25x = {budget:,} B ({budget / 2**20:.2f} MiB)")
    profiles: dict[str, Profile] = {}
    for precision in ("auto", "bf16"):
        _planned(precision, budget, profiles)
    if "fp32" in profiles:
        _fp32_table(profiles["fp32"], budget)


if __name__ == "__main__":
    main()
