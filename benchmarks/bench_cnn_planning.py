"""What planning costs on CNNs of many small blocks: ``memfit.plan``'s wall time as a multiple
of one plain training step of the same model, measured side by side in one process.

Models (torchvision and timm, random weights, defaults otherwise): GoogLeNet with its
auxiliary heads (loss = CE(main) + 0.3 * (CE(aux1) + CE(aux2))), MobileNetV2 and timm's
RegNetX-200MF, each on 64x64 images. For each: the median of ``--steps`` plain SGD steps
after one warm-up, then ``memfit.plan`` at the budget halfway between full checkpointing's measured peak and
the plain one (fp32, the
check of the result off: planning alone), then the plain steps again; the ratio is the plan's
seconds over the median of both step medians. The goal is at most 30 baseline steps. The
planner's own account of where its time went (its ``measured`` lines) is printed too.

Run (needs the extras environment):
    HF_HUB_OFFLINE=1 .venv-extras/bin/python benchmarks/bench_cnn_planning.py [--batch 16] [--steps 5]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import memfit
from memfit.budget import format_bytes

GOAL = 30.0
"""Planning should cost at most this many plain steps."""


def _ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _aux_ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    out = model(x)
    ce = nn.functional.cross_entropy
    return ce(out.logits, y) + 0.3 * (ce(out.aux_logits1, y) + ce(out.aux_logits2, y))


def _models() -> list[tuple[str, Callable[[], nn.Module], Any]]:
    import timm
    import torchvision

    tv = torchvision.models
    return [
        ("torchvision googlenet (aux heads)",
         lambda: tv.googlenet(aux_logits=True, init_weights=True, num_classes=10), _aux_ce),
        ("torchvision mobilenet_v2", lambda: tv.mobilenet_v2(num_classes=10), _ce),
        ("timm regnetx_002", lambda: timm.create_model("regnetx_002", pretrained=False, num_classes=10), _ce),
    ]  # fmt: skip


def _step_seconds(model: nn.Module, batch: Any, loss_fn: Any, opt: Any, steps: int) -> float:
    times = []
    for k in range(steps + 1):
        started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        opt.step()
        if k:  # the first is a warm-up
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    when = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    where = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"{when}, {where}, torch {torch.__version__}, batch {args.batch} of 64x64")
    print("| model | blocks | plain peak | budget | plain step s | plan s | plan / step |")
    print("|---|---|---|---|---|---|---|")
    details = []
    for name, build, loss_fn in _models():
        torch.manual_seed(0)
        model = build().train()
        g = torch.Generator().manual_seed(0)
        n = args.batch
        batch = (torch.randn(n, 3, 64, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        before = _step_seconds(model, batch, loss_fn, opt, args.steps)
        peak = memfit.measure(model, batch, loss_fn, opt, "fp32", steps=1).peak_bytes
        memfit.checkpoint(model, mode="full")
        full = memfit.measure(model, batch, loss_fn, opt, "fp32", steps=1).peak_bytes
        memfit.uncheckpoint(model)
        budget = (full + peak) // 2
        started = time.perf_counter()
        plan = memfit.plan(model, batch, loss_fn, budget, opt, "fp32", check=False)
        seconds = time.perf_counter() - started
        after = _step_seconds(model, batch, loss_fn, opt, args.steps)
        step = statistics.median([before, after])
        blocks = len(plan.blocks)
        print(f"| {name} | {blocks} | {format_bytes(peak)} | {format_bytes(budget)} | {step:.3f} | "
              f"{seconds:.1f} | {seconds / step:.1f}x |", flush=True)  # fmt: skip
        details.append((name, plan.report.measured))
    for name, lines in details:
        print(f"\n{name}: where planning's time went")
        for line in lines:
            print(f"- {line}")
    print(f"\ngoal: plan / step <= {GOAL:.0f}")


if __name__ == "__main__":
    main()
