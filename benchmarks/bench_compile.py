"""Compiled training: memfit's checkpointing under torch.compile, against the compiler's own trade-off.

Every variant is the same built-in GPT (same weights) compiled with inductor: plain;
checkpointed by memfit (full, selective, every 2nd block); memfit's plan for ``--budget``
(made in eager mode, applied, then compiled); and, on CUDA, plain with
``torch._functorch.config.activation_memory_budget`` at each ``--amb`` fraction (the
compiler's own memory/recompute knob). After a compiling warm-up step, the timed steps run
interleaved (A B C ... A B C) and the median is reported as a ratio to compiled plain.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` around one steady step, less what
the process holds that the variant does not own (the other variants' weights and optimizer
state, the batch), so that each peak is the variant's own. On a CPU
PyTorch's MemTracker does not see inductor's buffers, so only correctness (the first
step's loss against compiled plain) and time ratios are reported.

Run: ``.venv/bin/python benchmarks/bench_compile.py [--device cuda] [--rounds N]``
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config

import memfit
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.step import training_step


def _variants(
    base: GPT, batch: Any, budget: str, amb: list[float], cuda: bool
) -> dict[str, tuple[GPT, float]]:
    """name -> (model to compile, activation_memory_budget to compile it with)."""
    out: dict[str, tuple[GPT, float]] = {"compiled plain": (copy.deepcopy(base), 1.0)}
    for name, kwargs in {
        "memfit full": {"mode": "full"},
        "memfit selective": {"mode": "selective"},
        "memfit every 2nd": {"mode": "full", "every": 2},
    }.items():
        out[name] = (memfit.checkpoint(copy.deepcopy(base), **kwargs), 1.0)
    planned = copy.deepcopy(base)
    plan = memfit.plan(planned, batch, gpt_loss, budget, precision="fp32", check=False)
    memfit.apply(planned, plan)
    counts = {m: list(plan.blocks.values()).count(m) for m in set(plan.blocks.values())}
    out[f"memfit plan @{budget} {counts}"] = (planned, 1.0)
    for fraction in amb if cuda else []:
        out[f"activation_memory_budget={fraction}"] = (copy.deepcopy(base), fraction)
    return out


def _step(compiled: Callable[..., Any], opt: torch.optim.Optimizer, batch: Any) -> float:
    return training_step(compiled, batch, gpt_loss, opt, memfit.Precision("fp32")).loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--budget", default="60%")
    parser.add_argument("--amb", default="0.5,0.3,0.1", help="activation_memory_budget fractions (CUDA)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    inductor_config.compile_threads = 1 if not cuda else inductor_config.compile_threads
    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64), block_size=args.seq
    )
    base = GPT(cfg).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (args.batch_size, args.seq + 1), generator=g).to(device)
    batch = (x[:, :-1], x[:, 1:])
    amb = [float(f) for f in args.amb.split(",") if f]
    runs: dict[str, dict[str, Any]] = {}
    for name, (model, fraction) in _variants(base, batch, args.budget, amb, cuda).items():
        torch._dynamo.reset()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        compiled = torch.compile(model)
        started = time.perf_counter()
        with functorch_config.patch(activation_memory_budget=fraction):
            first = _step(compiled, opt, batch)  # compiles forward and backward
        compile_s = time.perf_counter() - started
        peak = 0
        if cuda:
            torch.cuda.synchronize(device)
            # every variant's weights are resident (and the earlier ones' optimizer state): the
            # allocator's peak is taken above what this variant does not own
            others = torch.cuda.memory_allocated(device) - _own_bytes(model, opt)
            torch.cuda.reset_peak_memory_stats(device)
            _step(compiled, opt, batch)
            torch.cuda.synchronize(device)
            peak = int(torch.cuda.max_memory_allocated(device)) - others
        runs[name] = {"compiled": compiled, "opt": opt, "first": first, "compile_s": compile_s, "peak": peak}
        runs[name]["times"] = []
    for _ in range(args.rounds):
        for run in runs.values():
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            _step(run["compiled"], run["opt"], batch)
            if cuda:
                torch.cuda.synchronize(device)
            run["times"].append(time.perf_counter() - start)
    ref = runs["compiled plain"]
    ref_time = statistics.median(ref["times"])
    print(f"# Compiled checkpointing, {datetime.date.today()}")
    print(
        f"machine: {platform.processor() or platform.machine()}, device {device}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(
        f"model: built-in GPT {cfg.n_layer} x {cfg.n_embd}, seq {cfg.block_size}, batch {args.batch_size}, "
        f"AdamW, fp32, inductor; {args.rounds} interleaved rounds after a compiling warm-up\n"
    )
    print("| variant | first-step loss - compiled plain | compile s | peak bytes (CUDA) | step time ratio |")
    print("|---|---|---|---|---|")
    for name, run in runs.items():
        peak = f"{run['peak']:,}" if cuda else "n/a (CPU)"
        ratio = statistics.median(run["times"]) / ref_time
        print(
            f"| {name} | {run['first'] - ref['first']:+.2e} | {run['compile_s']:.1f} | {peak} | {ratio:.2f} |"
        )


def _own_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the storages of ``model``'s weights, buffers, gradients and ``opt``'s state."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda}
    return sum(storages.values())


if __name__ == "__main__":
    main()
