"""Foundation benchmark: peak bytes and step-time ratios of the building blocks, side by side.

The built-in GPT (default size) is measured in fp32, bf16 autocast, and fp32 with full,
selective and every-2nd-block checkpointing. Peak bytes come from ``memfit.measure``
(MemTracker on a CPU); step times are medians of interleaved rounds (A B C ... A B C) so
that drift of a noisy machine hits every variant alike, reported as ratios to fp32.

Run: ``.venv/bin/python benchmarks/bench_foundation.py [--rounds N]``
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import statistics
import time

import torch

import memfit
from memfit.app.data import BatchSampler, ByteCorpus
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.step import training_step

VARIANTS = {
    "fp32": ("fp32", {}),
    "bf16": ("bf16", {}),
    "full": ("fp32", {"mode": "full"}),
    "selective": ("fp32", {"mode": "selective"}),
    "every=2": ("fp32", {"mode": "full", "every": 2}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig()
    corpus = ByteCorpus.load("stdlib", max_bytes=1_000_000)
    batch = BatchSampler(corpus.train, args.batch_size, cfg.block_size, seed=0).batch_at(0)
    base = GPT(cfg)
    runs = {}
    for name, (precision, ckpt) in VARIANTS.items():
        model = copy.deepcopy(base)
        if ckpt:
            memfit.checkpoint(model, **ckpt)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        prec = memfit.Precision(precision, device="cpu")
        report = memfit.measure(model, batch, gpt_loss, opt, precision=prec, steps=1)
        training_step(model, batch, gpt_loss, opt, prec)  # warm-up
        runs[name] = (model, opt, prec, report, [])
    for _ in range(args.rounds):
        for model, opt, prec, _, times in runs.values():
            start = time.perf_counter()
            training_step(model, batch, gpt_loss, opt, prec)
            times.append(time.perf_counter() - start)
    base_report, base_time = runs["fp32"][3], statistics.median(runs["fp32"][4])
    print(f"# Foundation benchmark, {datetime.date.today()}")
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )
    print(
        f"model: built-in GPT {cfg.n_layer} layers x {cfg.n_embd} wide, {cfg.n_head} heads, "
        f"seq {cfg.block_size}, batch {args.batch_size}, AdamW; {args.rounds} interleaved rounds\n"
    )
    print("| variant | peak bytes | peak ratio | activation bytes | step time ratio |")
    print("|---|---|---|---|---|")
    for name, (_, _, _, report, times) in runs.items():
        print(
            f"| {name} | {report.peak_bytes:,} | {report.peak_bytes / base_report.peak_bytes:.3f} | "
            f"{report.activation_bytes:,} | {statistics.median(times) / base_time:.2f} |"
        )


if __name__ == "__main__":
    main()
