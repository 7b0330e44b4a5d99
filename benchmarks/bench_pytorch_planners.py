"""memfit against PyTorch's own planners, side by side: peaks and step times at 70%, 50%, 35%.

For each model (memfit's GPT 6 x 384 at batch 16 x 256, a Hugging Face Llama from its config
when transformers is installed, a ResNet-18-style CNN at 64 x 3 x 128 x 128; see
``pressure_models.py``), fp32, AdamW, the plain eager step's peak by MemTracker is 100%, and
at each budget (a fraction of it) these run in one process, same weights, each with its own
optimizer:

- memfit's eager plan (``memfit.plan`` at the budget, applied);
- ``torch.utils.checkpoint`` on every block, plain and with PyTorch's selective checkpointing
  (torchtitan's policy: keep matmul, convolution and attention outputs);
- ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` at each of
  ``--amb`` (1.0 is compile's plain step): the fastest setting whose peak meets the budget;
- PyTorch's SAC estimator + MILP (``torch.distributed._tools``, fake tensors, ops timed on
  the CPU through a patched timing function), its per-module policies applied; needs PuLP;
- memfit's compiled plan (``memfit.prepare(..., compile=True)``) at ``--compiled-budgets``
  (70%), against compile's own budget that meets it.

Peaks: MemTracker (exact bytes) for eager steps; for compiled ones, which MemTracker cannot see
inside, the resident set's growth during the step (``VmHWM``, glibc mapping each allocation of
64 KiB or more on its own) plus the bytes held before it; the eager plain step is measured both
ways so the two can be compared. Times: one step of each variant per round, interleaved, after
warm-up steps (which compile); medians, as ratios to the plain eager step. Timing is never
asserted in tests: run this on a quiet machine and copy its output into RESULTS.md.

Run (the extras environment adds the Hugging Face model; ``pip install pulp`` adds the MILP):
    .venv/bin/python benchmarks/bench_pytorch_planners.py --model gpt-6x384 --model resnet
    HF_HUB_OFFLINE=1 .venv-extras/bin/python benchmarks/bench_pytorch_planners.py --model hf-llama
    .venv/bin/python benchmarks/bench_pytorch_planners.py --model gpt-readme --budgets 0.5 --amb 1.0,0.3
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytorch_planners as pt
import torch
from pressure_models import Case, build
from torch import nn

import memfit
from memfit.devices import return_freed_address_space
from memfit.measuring.phases import optimizer_state_bytes
from memfit.precision import Precision
from memfit.step import training_step


@dataclass
class Variant:
    """One way to run the step: its model, optimizer, and what was measured."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    compiled: bool = False
    plan: memfit.Plan | None = None
    tracked: int = 0
    """MemTracker's peak (eager steps only; 0: not measured)."""
    resident: int = 0
    """Bytes held before the step plus the resident set's growth during it."""
    times: list[float] = field(default_factory=list)
    note: str = ""

    def step(self, case: Case) -> None:
        if self.plan is not None:
            memfit.train_step(self.model, case.batch, case.loss_fn, self.optimizer, self.plan)
        else:
            training_step(self.model, case.batch, case.loss_fn, self.optimizer, Precision("fp32"))

    def peak(self, base: int) -> int:
        """The peak compared with budgets: MemTracker's where measured, else the resident one
        scaled to MemTracker's measure of the plain step (``base``: the plain step's ratio)."""
        return self.tracked if self.tracked else int(self.resident * base / 1e6)


def _held(v: Variant, batch: Any) -> int:
    tensors = [*v.model.parameters(), *v.model.buffers()]
    tensors += [t for t in (batch if isinstance(batch, tuple) else (batch,)) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors) + sum(
        optimizer_state_bytes(v.optimizer).values()
    )


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters())  # every case's optimizer (pressure_models.py)


def _variant(name: str, case: Case, model: nn.Module, **kw: Any) -> Variant:
    return Variant(name, model, _adamw(model), **kw)


def _eager(case: Case, base: int, budgets: list[float]) -> list[Variant]:
    out = [_variant("plain eager", case, case.model)]
    for b in budgets:
        model = copy.deepcopy(case.model)
        opt = _adamw(model)
        try:
            plan = memfit.plan(model, case.batch, case.loss_fn, int(b * base), opt, "fp32")
        except memfit.InfeasibleBudget as exc:
            print(f"memfit @{b:.0%}: {exc}")
            continue
        model, opt = memfit.prepare(model, opt, plan)
        counts = ", ".join(
            f"{m} x{list(plan.blocks.values()).count(m)}" for m in sorted(set(plan.blocks.values()))
        )
        v = Variant(f"memfit eager @{b:.0%}", model, opt, plan=plan)
        v.note = f"{counts}, {len(plan.segments)} segment(s), {plan.micro_batches} micro-batch(es)"
        out.append(v)
    out.append(_variant("full AC every block", case, pt.full_every_block(case.model, case.block_class)))
    out.append(_variant("SAC every block", case, pt.sac_every_block(case.model, case.block_class)))
    return out


def _compiled(case: Case, ambs: list[float], base: int, memfit_budgets: list[float]) -> list[Variant]:
    out = []
    for amb in ambs:
        v = _variant(f"compile amb={amb}", case, pt.compiled(case.model, amb), compiled=True)
        v.step(case)  # compiles
        out.append(v)
    for b in memfit_budgets:
        model = copy.deepcopy(case.model)
        opt = _adamw(model)
        plan = memfit.plan(model, case.batch, case.loss_fn, int(b * base), opt, "fp32")
        model, opt = memfit.prepare(model, opt, plan, compile=True)
        v = Variant(f"memfit compiled @{b:.0%}", model, opt, compiled=True, plan=plan)
        v.step(case)  # compiles
        out.append(v)
    return out


def _milp(name: str, base: int, budgets: list[float], case: Case) -> list[Variant]:
    out = []
    for b in budgets:
        try:
            decisions, peak, apply = pt.sac_milp_policy(lambda: _fresh(name), int(b * base))
        except Exception as exc:  # PuLP missing, an estimator that cannot run this model
            print(f"SAC MILP @{b:.0%}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        if peak < 0:
            print(f"SAC MILP @{b:.0%}: no solution")
            continue
        v = _variant(f"SAC MILP @{b:.0%}", case, apply(case.model))
        v.note = (
            f"predicted {peak:,} B; discards {dict((k, round(r, 2)) for k, r in decisions.items() if r > 0)}"
        )
        out.append(v)
    return out


def _fresh(name: str) -> tuple[nn.Module, Any, Callable[..., torch.Tensor], torch.optim.Optimizer]:
    c = build(name)
    return c.model, c.batch, c.loss_fn, c.optimizer


def _measure(case: Case, variants: list[Variant], rounds: int) -> list[Variant]:
    """Peaks and step times of ``variants``; returns those whose step ran (one that raises is
    printed with its error, and left out)."""
    ran = []
    for v in variants:
        try:
            v.step(case)  # the optimizer's state, and a warm-up
        except Exception as exc:  # a strategy PyTorch refuses on this model: a result, reported
            print(f"{v.name}: its step fails: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            continue
        ran.append(v)
        v.resident = _held(v, case.batch) + pt.rss_peak(lambda v=v: v.step(case))
        if not v.compiled:
            prec, micro = (v.plan.precision, v.plan.micro_batches) if v.plan is not None else ("fp32", 1)
            v.tracked = memfit.measure(
                v.model, case.batch, case.loss_fn, v.optimizer, prec, 1, micro
            ).peak_bytes
    for _ in range(rounds):
        for v in ran:
            started = time.perf_counter()
            v.step(case)
            v.times.append(time.perf_counter() - started)
    return ran


def _report(name: str, base: int, variants: list[Variant], budgets: list[float]) -> None:
    plain = next(v for v in variants if v.name == "plain eager")
    scale = 1e6 * plain.tracked / plain.resident  # MemTracker's bytes per resident byte, x1e6
    t0 = statistics.median(plain.times)
    print(f"\n## {name}: plain eager peak {base:,} B (MemTracker), {plain.resident:,} B resident")
    print("\n| variant | peak (B) | by | of plain | step time x plain | |")
    print("|---|---:|---|---:|---:|---|")
    for v in variants:
        by = "MemTracker" if v.tracked else "resident, scaled"
        ratio = statistics.median(v.times) / t0
        peak = v.peak(int(scale))
        print(f"| {v.name} | {peak:,} | {by} | {peak / base:.3f} | {ratio:.2f} | {v.note} |")
    print("\n| budget | memfit eager x plain | fastest PyTorch strategy that fits | x plain | memfit / it |")
    print("|---:|---:|---|---:|---:|")
    for b in budgets:
        mine = next((v for v in variants if v.name == f"memfit eager @{b:.0%}"), None)
        theirs = [v for v in variants if not v.name.startswith("memfit") and v.peak(int(scale)) <= b * base]
        best = min(theirs, key=lambda v: statistics.median(v.times), default=None)
        m = statistics.median(mine.times) / t0 if mine else float("nan")
        t = statistics.median(best.times) / t0 if best else float("nan")
        print(f"| {b:.0%} | {m:.2f} | {best.name if best else 'none fits'} | {t:.2f} | {m / t:.2f} |")
    _compiled_report(variants, base, scale)


def _compiled_report(variants: list[Variant], base: int, scale: float) -> None:
    for mine in (v for v in variants if v.name.startswith("memfit compiled @")):
        b = float(mine.name.split("@")[1].rstrip("%")) / 100
        fits = [v for v in variants if v.name.startswith("compile amb=") and v.peak(int(scale)) <= b * base]
        best = min(fits, key=lambda v: statistics.median(v.times), default=None)
        ratio = statistics.median(mine.times) / statistics.median(best.times) if best else float("nan")
        theirs = best.name if best else "none"
        print(
            f"\n{mine.name}: peak {mine.peak(int(scale)) / base:.3f} of plain; compile's own budget that "
            f"meets {b:.0%}: {theirs}; memfit compiled / it: {ratio:.2f} (goal <= 1.00)"
        )


def run(name: str, args: argparse.Namespace) -> None:
    return_freed_address_space()  # See pytorch_planners.rss_peak
    case = build(name)
    base = memfit.measure(case.model, case.batch, case.loss_fn, case.optimizer, steps=1).peak_bytes
    variants = _eager(case, base, args.budgets)
    if args.amb:
        variants += _compiled(case, args.amb, base, args.compiled_budgets)
    if not args.no_milp:
        variants += _milp(name, base, args.budgets, case)
    _report(name, base, _measure(case, variants, args.rounds), args.budgets)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="gpt-6x384, hf-llama, resnet (default: all three)")
    ap.add_argument("--budgets", type=_floats, default=[0.70, 0.50, 0.35])
    ap.add_argument("--amb", type=_floats, default=[1.0, 0.6, 0.4, 0.2, 0.1, 0.0])
    ap.add_argument("--compiled-budgets", type=_floats, default=[0.70])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-milp", action="store_true")
    args = ap.parse_args()
    when = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    print(f"# bench_pytorch_planners.py: {when}, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
    for name in args.model or ["gpt-6x384", "hf-llama", "resnet"]:
        try:
            run(name, args)
        except ImportError as exc:
            print(f"\n## {name}: skipped ({exc})")


if __name__ == "__main__":
    main()
