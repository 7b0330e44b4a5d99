"""The planner against PyTorch's own strategies, and what planning costs.

Part 1 (``--part compare``): five models (the README's built-in GPT, blocks of different
sizes, a ResNet-style CNN with BatchNorm, Hugging Face GPT-2 from a config, a torchvision
ViT), each at budgets 25%, 50% and 75% of the way from full checkpointing's measured peak
to keeping everything's. Per repeat: ``memfit.plan`` at each budget, then one interleaved
``memfit.bench`` run of the three plans and PyTorch's strategies (full per block, every 2nd
block, ``checkpoint_sequential`` with sqrt(n) segments, selective); the ratio is the plan's
median step time over the fastest built-in strategy whose measured peak fits the budget.

Part 2 (``--part time``): wall time of ``memfit.plan`` at 60% as a multiple of the model's
median baseline step measured in the same run (the README's GPT five times, which also
shows whether the plans agree; a 12-layer 256-wide GPT at sequence 256; GPT-2 from a
config), and how long an impossible budget takes to be refused.

Run (the HF and ViT models need the extras environment):
    HF_HUB_OFFLINE=1 .venv-extras/bin/python benchmarks/bench_plan.py [--repeats 3] [--steps 25]
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
from memfit.benchmarking.planned import plan_strategy
from memfit.benchmarking.sweep import bench
from memfit.budget import format_bytes
from memfit.checkpointing import checkpoint, uncheckpoint
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.precision import Precision
from memfit.records import BenchPoint, Plan
from memfit.step import training_step

COMPARED = ["fp32/full", "fp32/every2", "fp32/sequential", "fp32/selective"]
BUILTIN = ["fp32/none", *COMPARED]
FRACTIONS = (0.25, 0.50, 0.75)
Case = tuple[Callable[[], nn.Module], Any, Callable[..., torch.Tensor]]


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

    def __init__(self, width: int = 32, hidden: tuple[int, ...] = (32, 256, 64, 128) * 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Wide(width, h) for h in hidden)
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class _Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += identity
        return self.relu(out)


class ResNetish(nn.Module):
    """A CIFAR-style ResNet with BatchNorm: stem at full resolution, three stages of 2 blocks."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(True)
        )
        blocks, cin = [], width
        for i in range(3):
            cout = width * 2**i
            blocks += [_Basic(cin, cout, 1 if i == 0 else 2), _Basic(cout, cout, 1)]
            cin = cout
        self.stages = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.stages(self.stem(x)).mean(dim=(2, 3)))


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _hf_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[1]).loss  # type: ignore[no-any-return]


def _readme_gpt() -> nn.Module:
    return GPT(GPTConfig(n_layer=4, n_embd=128))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    # NOTE: use_cache=False until selective checkpointing handles the default cache (issue 11).
    cfg = GPT2Config(n_layer=6, n_embd=256, n_head=8, n_positions=256, vocab_size=8192, use_cache=False)
    return GPT2LMHeadModel(cfg)


def _vit() -> nn.Module:
    from torchvision.models import VisionTransformer

    return VisionTransformer(
        image_size=64, patch_size=8, num_layers=6, num_heads=4, hidden_dim=128, mlp_dim=512, num_classes=10
    )


def _cases() -> dict[str, Case]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (8, 129), generator=g)
    hf_tokens = torch.randint(0, 8192, (8, 128), generator=g)
    return {
        "gpt": (_readme_gpt, (tokens[:, :-1], tokens[:, 1:]), gpt_loss),
        "uneven": (UnevenNet, (torch.randn(1024, 32, generator=g), torch.randn(1024, 1, generator=g)), _mse),
        "resnet": (
            ResNetish,
            (torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)),
            _ce,
        ),
        "gpt2": (_gpt2, (hf_tokens, hf_tokens), _hf_loss),
        "vit": (
            _vit,
            (torch.randn(32, 3, 64, 64, generator=g), torch.randint(0, 10, (32,), generator=g)),
            _ce,
        ),
    }


TITLES = {
    "gpt": "README GPT (4 x 128, seq 128, batch 8)",
    "uneven": "12 residual MLP blocks, hidden 32..256 (batch 1024)",
    "resnet": "ResNet-style CNN with BatchNorm (6 blocks, width 32..128, 32x32, batch 32)",
    "gpt2": "HF GPT-2 from config (6 x 256, vocab 8192, seq 128, batch 8, use_cache=False)",
    "vit": "torchvision ViT (6 x 128, patch 8, 64x64, batch 32)",
}


def _peak(model: nn.Module, batch: Any, loss_fn: Any, opt: torch.optim.Optimizer, mode: str) -> int:
    uncheckpoint(model)
    if mode != "none":
        checkpoint(model, mode=mode)
    try:
        return memfit.measure(model, batch, loss_fn, opt, "fp32", steps=1).peak_bytes
    finally:
        uncheckpoint(model)


def _letters(plan: Plan) -> str:
    inside = {n: k for k, seg in enumerate(plan.segments, 1) for n in seg}
    return " ".join(f"[{inside[n]}]" if n in inside else m[0].upper() for n, m in plan.blocks.items())


def compare(name: str, repeats: int, steps: int) -> None:
    make, batch, loss_fn = _cases()[name]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters())
    none, full = _peak(model, batch, loss_fn, opt, "none"), _peak(model, batch, loss_fn, opt, "full")
    budgets = [int(full + f * (none - full)) for f in FRACTIONS]
    print(f"### {TITLES[name]}: fp32/none {format_bytes(none)}, fp32/full {format_bytes(full)}\n")
    ratios: dict[int, list[float]] = {b: [] for b in budgets}
    lines: list[str] = []
    for r in range(1, repeats + 1):
        strategies, plans = [], {}
        for f, b in zip(FRACTIONS, budgets, strict=True):
            plans[b] = memfit.plan(model, batch, loss_fn, b, opt)
            strategies.append(plan_strategy(plans[b], f"plan@{f:.0%}"))
        points = {
            p.strategy: p
            for p in bench(model, batch, loss_fn, opt, strategies=[*BUILTIN, *strategies], steps=steps)
        }
        base = points["fp32/none"].step_seconds
        lines.append(f"- repeat {r}: " + ", ".join(f"{n} {_t(points[n], base)}" for n in BUILTIN))
        for f, b in zip(FRACTIONS, budgets, strict=True):
            p = points[f"plan@{f:.0%}"]
            fits = [points[n] for n in COMPARED if points[n].ok and points[n].peak_bytes <= b]
            best = min(fits, key=lambda q: q.step_seconds) if fits else None
            ratio = p.step_seconds / best.step_seconds if best and p.ok else float("nan")
            ratios[b].append(ratio)
            plan = plans[b]
            lines.append(
                f"  - plan@{f:.0%} ({format_bytes(b)}): {_letters(plan)}, peak predicted "
                f"{format_bytes(plan.predicted_peak_bytes)}, measured {format_bytes(p.peak_bytes)}, time "
                f"{_t(p, base)}; best fitting built-in {best.strategy if best else 'none'} "
                f"{_t(best, base) if best else ''}: ratio {ratio:.2f}"
            )
    print("| budget | bytes | plan / fastest fitting built-in, per repeat | median |")
    print("|---|---|---|---|")
    for f, b in zip(FRACTIONS, budgets, strict=True):
        rs = ratios[b]
        each = ", ".join(f"{x:.2f}" for x in rs)
        print(f"| {f:.0%} | {format_bytes(b)} | {each} | {statistics.median(rs):.2f} |")
    print()
    print("\n".join(lines))
    print()


def _t(p: BenchPoint, base: float) -> str:
    if not p.ok:
        return "(failed)"
    return f"{format_bytes(p.peak_bytes)} {p.step_seconds / base:.2f}x"


def _baseline_step(
    model: nn.Module, batch: Any, loss_fn: Any, opt: torch.optim.Optimizer, n: int = 5
) -> float:
    prec = Precision("fp32")
    times = []
    for _ in range(n + 1):
        start = time.perf_counter()
        training_step(model, batch, loss_fn, opt, prec)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def planning_time(name: str, runs: int) -> list[str]:
    """Print one table row; return lines about refused budgets (printed after the table)."""
    if name == "gpt12":
        model: nn.Module = GPT(GPTConfig(n_layer=12, n_embd=256, block_size=256))
        tokens = torch.randint(0, 256, (8, 257), generator=torch.Generator().manual_seed(1))
        batch: Any = (tokens[:, :-1], tokens[:, 1:])
        loss_fn: Any = gpt_loss
        title = "built-in GPT 12 x 256, seq 256, batch 8"
    else:
        make, batch, loss_fn = _cases()[name]
        torch.manual_seed(0)
        model = make()
        title = TITLES[name]
    opt = torch.optim.AdamW(model.parameters())
    step = _baseline_step(model, batch, loss_fn, opt)
    plans = []
    for _ in range(runs):
        plans.append(memfit.plan(model, batch, loss_fn, "60%", opt))
    secs = [p.report.planning_seconds for p in plans]
    same = len({(str(p.blocks), str(p.segments), p.precision, p.micro_batches) for p in plans}) == 1
    print(
        f"| {title} | {step * 1e3:.0f} ms | {', '.join(f'{s:.1f}' for s in secs)} s | "
        f"{', '.join(f'{s / step:.1f}' for s in secs)} | {_letters(plans[0])} | {'yes' if same else 'NO'} |"
    )
    lines = []
    if name == "gpt12":
        for budget in ("5%", "100KB"):
            start = time.perf_counter()
            try:
                memfit.plan(model, batch, loss_fn, budget, opt)
                lines.append(f"- {title}, {budget}: not refused")
            except memfit.InfeasibleBudget as exc:
                lines.append(f"- {title}, {budget} refused in {time.perf_counter() - start:.2f} s: {exc}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=("compare", "time", "all"), default="all")
    parser.add_argument("--only", nargs="+", choices=[*_cases(), "gpt12"], help="these models only")
    parser.add_argument("--repeats", type=int, default=3, help="bench runs per model (part 1)")
    parser.add_argument("--steps", type=int, default=25, help="timed steps per strategy and run, interleaved")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (the shared CPU thrashes with more)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# {stamp} on {platform.machine()}, torch {torch.__version__}, {args.threads} thread(s)")
    options = f"--part {args.part} --repeats {args.repeats} --steps {args.steps}"
    print(f"# command: benchmarks/bench_plan.py {options}\n")
    if args.part in ("compare", "all"):
        for name in _cases():
            if not args.only or name in args.only:
                compare(name, args.repeats, args.steps)
    if args.part in ("time", "all"):
        print(
            "| model | baseline step | planning wall time | in baseline steps | plan | same plan each run |"
        )
        print("|---|---|---|---|---|---|")
        after: list[str] = []
        for name, runs in (("gpt", 5), ("gpt12", 1), ("gpt2", 1)):
            if not args.only or name in args.only:
                after += planning_time(name, runs)
        print()
        print("\n".join(after))


if __name__ == "__main__":
    main()
