"""``memfit estimate``: a training step's memory for every precision x checkpointing mode, allocating nothing.

Example:
    memfit estimate --set model.n_layer=12 --set model.n_embd=768 --device-memory 24GiB
    memfit estimate --set model.name=import:memfit.models.llama:llama --set model.kwargs.preset=7b \\
        --set train.batch_size=1 --device-memory 80GiB
"""

from __future__ import annotations

import argparse

from memfit.app.build import build_model
from memfit.budget import format_bytes, parse_bytes
from memfit.cli.common import add_config_arguments, config_from_args
from memfit.cli.model_args import batch_for, describe, optimizer_fn, spec_for
from memfit.levers.spec import allowed_levers, normalize_levers
from memfit.measuring.estimate import estimate
from memfit.planning.lever_sets import smallest_with_levers
from memfit.records import Estimate
from memfit.report.memory_tables import strategy_table, verdict_line
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
    parser.add_argument(
        "--levers",
        default=None,
        help="also print the smallest step these levers allow (comma-separated names or 'all')",
    )
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")


def check(args: argparse.Namespace) -> None:
    """Refuse a bad config or ``--device-memory`` before estimating."""
    if args.device_memory is not None:
        parse_bytes(args.device_memory, what="device memory")
    normalize_levers(args.levers)
    config_from_args(args)


class _Named:
    """Stands for the optimizer in lever refusals, which read only its family name."""

    def __init__(self, name: str) -> None:
        self.memfit_family = name


def lever_line(est: Estimate, memory: int | None) -> str:
    """The smallest step with levers, its peak and bytes per parameter, and whether it fits."""
    e = est.with_levers
    if e is None:
        return (
            "with levers: none of the levers asked for can be predicted here (torchao missing, or not AdamW)."
        )
    state = sum(e.breakdown.get(k, 0) for k in ("params", "grads", "optimizer"))
    fits = (
        ""
        if memory is None
        else f"; {'fits' if e.peak_bytes <= memory else 'does not fit'} {format_bytes(memory)}"
    )
    return (
        f"smallest plan with levers {', '.join(e.levers)}: {e.precision}, {e.mode} checkpointing, peak "
        f"{format_bytes(e.peak_bytes)} ({e.peak_bytes / est.param_count:.2f} bytes per parameter; "
        f"model state {state / est.param_count:.2f}){fits}"
    )


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
        levers=bool(args.levers),
    )
    if args.levers:
        # offload is left out: its bytes are not in the step model (and a CPU refuses it)
        allowed, _ = allowed_levers(
            [n for n in normalize_levers(args.levers) if n != "offload"],
            device="cpu",
            optimizer=None if est.optimizer == "none" else _Named(est.optimizer),  # type: ignore[arg-type]
            precision="auto",
        )
        est.with_levers = smallest_with_levers(est.profiles, allowed)
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
    verdict = verdict_line(est.ordered(), memory)
    print(f"without levers, {verdict}" if args.levers else verdict)
    if args.levers:
        print(lever_line(est, memory))
    return 0
