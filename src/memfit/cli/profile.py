"""``memfit profile``: per-block memory, time and FLOPs of the configured model under each checkpointing mode.

Example:
    memfit profile --set model.n_layer=4 --set train.batch_size=4 --device-memory 2GiB
    memfit profile run.toml --json > profile.json
"""

from __future__ import annotations

import argparse

from memfit.app.build import run_precision
from memfit.budget import format_bytes, parse_bytes
from memfit.cli.common import config_from_args, zero_grads_note
from memfit.cli.model_args import batch_for, describe, optimizer_fn, run_device, spec_for
from memfit.errors import ConfigError
from memfit.measuring.lever_facts import head_facts
from memfit.measuring.profile import profile
from memfit.outputs import check_output_file, marked_json, write_text
from memfit.planning.notes import block_notes
from memfit.precision import Precision
from memfit.records import EstimateEntry
from memfit.report.memory_tables import block_table, head_table, strategy_table, verdict_line
from memfit.stepmodel import simulate

__all__ = ["check", "run"]


def check(args: argparse.Namespace) -> None:
    """Refuse a bad config, device, ``--device-memory``, ``--repeats`` or ``--out`` before profiling."""
    if args.device_memory is not None:
        parse_bytes(args.device_memory, what="device memory")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {args.repeats}.")
    run_device(config_from_args(args))
    if args.out:
        check_output_file(args.out, "--out")


def run(args: argparse.Namespace) -> int:
    """Build the model on its device, profile it, print the block and strategy tables."""
    memory = None
    if args.device_memory is not None:
        memory = parse_bytes(args.device_memory, what="device memory")
    cfg = config_from_args(args)
    device = run_device(cfg)
    precision = Precision(args.precision or run_precision(cfg), device=device)
    spec = spec_for(cfg)
    model = spec.model.to(device)
    batch = batch_for(spec, cfg, device)
    opt = optimizer_fn(cfg)(model.parameters())
    blocks = args.blocks.split(",") if args.blocks else None
    prof = profile(model, batch, spec.loss_fn, opt, precision, repeats=args.repeats, blocks=blocks)
    if args.out:
        try:
            write_text(args.out, marked_json("profile", prof.to_dict()), "the profile")
        except ConfigError as exc:
            print(marked_json("profile", prof.to_dict()), end="")  # See Note [the work is not lost]
            raise ConfigError(f"{str(exc).rstrip('.')}; the profile is printed above.") from None
    if args.json:
        print(prof.to_json())
        return 0
    print(
        f"{type(model).__name__} on {prof.device}, {prof.precision}, batch {describe(batch)}, "
        f"{prof.optimizer}: {'measured' if prof.memory_from == 'tracked' else 'estimated'} peak "
        f"{format_bytes(prof.measured_peak_bytes)} with no checkpointing"
        + ("" if prof.plain_fits else " (under fake tensors: it does not fit here)")
        + f", step {prof.step_seconds * 1e3:.1f} ms"
    )
    print()
    print(block_table(prof))
    for line in block_notes(model, {b.name: "" for b in prof.blocks}):
        print(f"why: {line}")
    print()
    head = head_table(head_facts(model, batch, spec.loss_fn, prof.precision), prof.precision)
    if head is not None:
        print(head)
        print()
    entries = []
    for mode in prof.outside.saved_bytes:
        sim = simulate(prof, mode)
        entries.append(EstimateEntry(prof.precision, mode, sim.peak_bytes, sim.breakdown))
    print(strategy_table(entries, memory))
    grads = zero_grads_note(e.breakdown for e in entries)
    if grads:
        print(f"({grads}.)")
    for note in prof.notes:
        print(f"note: {note}")
    if args.out:
        print(f"profile written to {args.out}")
    print(verdict_line(entries, memory))
    return 0
