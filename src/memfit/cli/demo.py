"""``memfit demo``: the built-in GPT on the standard library's source, baseline vs memfit."""

from __future__ import annotations

import argparse

import torch

from memfit.budget import format_bytes
from memfit.checkpointing import checkpoint
from memfit.measure.memory import measure
from memfit.precision import Precision
from memfit.step import training_step
from memfit.train.data import BatchSampler, ByteCorpus
from memfit.train.gpt import GPT, GPTConfig, gpt_loss

HELP = "train the built-in GPT on Python's own source: the baseline, then in less memory"

__all__ = ["HELP", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--steps`` sets the training steps of the main run."""
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")


def run(args: argparse.Namespace) -> int:
    """Measure the baseline and the checkpointed model, then train a few steps."""
    torch.manual_seed(0)
    corpus = ByteCorpus.load("stdlib", max_bytes=2_000_000)
    cfg = GPTConfig()
    sampler = BatchSampler(corpus.train, batch_size=8, seq_len=cfg.block_size, seed=0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = sampler.batch_at(0)
    base = measure(model, batch, gpt_loss, opt, steps=2)
    checkpoint(model, mode="full")
    saved = measure(model, batch, gpt_loss, opt, steps=2)
    precision = Precision("fp32")
    for step in range(1, args.steps + 1):
        result = training_step(model, sampler.next_batch(), gpt_loss, opt, precision, clip_norm=1.0)
        if step == 1 or step % 5 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {result.loss:.4f}")
    print(
        f"\nbaseline peak {format_bytes(base.peak_bytes)}; checkpointed peak "
        f"{format_bytes(saved.peak_bytes)} ({saved.peak_bytes / base.peak_bytes:.2f}x), "
        f"step time {saved.step_seconds / base.step_seconds:.2f}x"
    )
    return 0
