"""``memfit estimate``: a training step's memory for every precision x checkpointing mode, allocating nothing.

Example:
    memfit estimate --set model.n_layer=12 --set model.n_embd=768 --device-memory 24GiB
    memfit estimate --set model.name=import:memfit.train.llama:llama --set model.kwargs.preset=7b \\
        --set train.batch_size=1 --device-memory 80GiB
"""

from __future__ import annotations

import argparse

from memfit.budget import format_bytes, parse_bytes
from memfit.cli.common import add_config_arguments, config_from_args
from memfit.cli.model_args import batch_for, describe, optimizer_fn, spec_for
from memfit.measuring.estimate import estimate
from memfit.report.memory_tables import strategy_table, verdict_line
from memfit.train.build import build_model
from memfit.vocab import PRECISIONS

HELP = "predict peak memory for every precision x checkpointing mode with fake tensors (no allocation)"

__all__ = ["HELP", "add_arguments", "check", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Config options, ``--device-memory``, ``--precision`` and ``--json``."""
    add_config_arguments(parser)
    parser.add_argument(
        "--device-memory",
        metavar="BYTES",
        help="memory of the device you will train on, e.g. 24GiB or 80GB; the last line says what fits",
    )
    parser.add_argument(
        "--precision",
        action="append",
        choices=PRECISIONS,
        help="estimate only this precision (repeatable; default: fp32, bf16 and fp16)",
    )
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")


def check(args: argparse.Namespace) -> None:
    """Refuse a bad config or ``--device-memory`` before estimating."""
    if args.device_memory is not None:
        parse_bytes(args.device_memory, what="device memory")
    config_from_args(args)


def run(args: argparse.Namespace) -> int:
    """Build the model under fake tensors, estimate, print the table and the verdict."""
    memory = None
    if args.device_memory is not None:
        memory = parse_bytes(args.device_memory, what="device memory")
    cfg = config_from_args(args)
    spec = spec_for(cfg, meta=True)
    batch = batch_for(spec, cfg)
    est = estimate(
        lambda: build_model(cfg.model).model,
        batch,
        spec.loss_fn,
        optimizer_fn(cfg),
        device_memory=memory,
        precisions=args.precision or PRECISIONS,
    )
    if args.json:
        print(est.to_json())
        return 0
    print(
        f"{est.model}: {est.param_count:,} parameters, batch {describe(batch)}, "
        f"{est.optimizer}; estimated on {est.device} in {est.seconds:.1f} s"
    )
    print()
    print(strategy_table(est.ordered(), memory))
    print()
    print("assumptions:")
    for line in est.assumptions:
        print(f"  - {line}")
    if memory is not None:
        print(f"device memory: {format_bytes(memory)}")
    print(verdict_line(est.ordered(), memory))
    return 0
