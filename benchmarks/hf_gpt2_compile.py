"""HF GPT-2 at its full default size (GPT2Config(), 124M parameters), planned and compiled.

The test suite trains a small GPT-2 (default settings, 3 x 64) compiled; this script runs
the default-sized one once: ``memfit.plan`` at ``--budget`` (fp32, eager), then
``memfit.prepare(..., compile=True)`` and ``--steps`` ``memfit.train_step`` calls on one
fixed batch, printing the plan, the losses, and the planning and compile times.

Run: ``HF_HUB_OFFLINE=1 PYTHONPATH=src .venv-extras/bin/python benchmarks/hf_gpt2_compile.py``
"""

from __future__ import annotations

import argparse
import itertools
import math
import time

import torch
import transformers

import memfit


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget", default="75%")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.GPT2Config()  # every default: 12 x 768, use_cache=True, dropout 0.1
    model = transformers.GPT2LMHeadModel(config)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, config.vocab_size, (args.batch_size, args.seq), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    started = time.perf_counter()
    plan = memfit.plan(model, x, _loss, args.budget, opt, precision="fp32")
    planned = time.perf_counter() - started
    counts = {m: list(plan.blocks.values()).count(m) for m in sorted(set(plan.blocks.values()))}
    print(f"GPT2Config() defaults: {n_params:,} parameters, use_cache={config.use_cache}")
    print(
        f"plan at {args.budget}: {counts}, segments {plan.segments}, {plan.micro_batches} micro-batch(es); "
        f"predicted {plan.predicted_peak_bytes:,} B, measured {plan.measured_peak_bytes:,} B, "
        f"baseline {plan.report.baseline_peak_bytes:,} B; planning {planned:.1f} s"
    )
    model, opt = memfit.prepare(model, opt, plan, compile=True)
    losses, times = [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        losses.append(memfit.train_step(model, x, _loss, opt, plan))
        times.append(time.perf_counter() - started)
    print(
        f"compiled steps: losses {[round(v, 4) for v in losses]}; first step (compiles) {times[0]:.1f} s, "
        f"later {min(times[1:]) if len(times) > 1 else float('nan'):.2f} s"
    )
    ok = all(math.isfinite(v) for v in losses) and all(a > b for a, b in itertools.pairwise(losses))
    print("finite and decreasing:", ok)


if __name__ == "__main__":
    main()
