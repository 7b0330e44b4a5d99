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
from memfit.cli.advice import speed_order
from memfit.cli.common import config_from_args, zero_grads_note
from memfit.cli.model_args import batch_for, describe, optimizer_fn, spec_for
from memfit.devices import DeviceFacts, device_facts, resolve_device, slow_precisions
from memfit.errors import ConfigError
from memfit.levers.spec import allowed_levers, missing_torchao_hint, normalize_levers
from memfit.measuring.estimate import estimate
from memfit.planning.lever_sets import smallest_with_levers
from memfit.records import Estimate, EstimateEntry
from memfit.report.memory_tables import head_table, strategy_table, verdict_line
from memfit.vocab import PRECISIONS

__all__ = ["check", "run"]


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


def lever_line(est: Estimate, memory: int | None, refused: dict[str, str] | None = None) -> str:
    """The smallest step with levers, its peak and bytes per parameter, and whether it fits."""
    e = est.with_levers
    if e is None:
        why = "; ".join((refused or {}).values()) or "the optimizer is not AdamW, or no lever facts"
        return f"with levers: none of the levers asked for can be predicted here ({why.rstrip('.')})."
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
    refused: dict[str, str] = {}
    if args.levers:
        # offload is left out: its bytes are not in the step model (and a CPU refuses it)
        allowed, refused = allowed_levers(
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
    facts = _speed_facts(cfg.train.device)
    ordered = speed_order(est.ordered(), facts)
    print(strategy_table(ordered, memory))
    grads = zero_grads_note(e.breakdown for e in ordered)
    if grads:
        print(f"({grads}.)")
    for precision, prof in est.profiles.items() if args.levers else ():
        table = head_table(prof.lever_facts.head if prof.lever_facts else None, precision)
        if table is not None and precision != "fp16":  # fp16's head is bf16's (Note [fp16 is bf16's memory])
            print()
            print(table)
    print()
    print("assumptions:")
    for line in est.assumptions:
        print(f"  - {line}")
    if memory is not None:
        print(f"device memory: {format_bytes(memory)}")
    note = _speed_note(ordered, facts)
    if note:
        print(note)
    verdict = verdict_line(ordered, memory)
    print(f"without levers, {verdict}" if args.levers else verdict)
    if args.levers:
        print(lever_line(est, memory, refused))
        hint = missing_torchao_hint(args.levers)
        if hint is not None and est.with_levers is not None:
            print(f"{hint[0].upper()}{hint[1:]}.")
    return 0


def _speed_facts(device: str) -> DeviceFacts | None:
    """What ``train.device`` runs fast, when it is on this machine (None: not here, e.g. a GPU elsewhere)."""
    try:
        return device_facts(resolve_device(device))
    except ConfigError:
        return None


def _speed_note(ordered: list[EstimateEntry], facts: DeviceFacts | None) -> str | None:
    """Why the emulated precisions come last (their memory is still what it says)."""
    slow = [p for p in (slow_precisions(facts) if facts else []) if any(e.precision == p for e in ordered)]
    if not slow or facts is None:
        return None
    one = len(slow) == 1
    return (
        f"speed: {' and '.join(slow)} {'is' if one else 'are'} emulated on {facts.name} (see memfit doctor), "
        f"so slow there and listed after fp32; {'it saves' if one else 'they save'} memory as shown."
    )
