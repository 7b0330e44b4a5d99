"""``memfit plan``: the fastest checkpointing / precision / micro-batching that fits a memory budget.

Example:
    memfit plan --budget 60% --set model.n_layer=4 --set train.batch_size=8
    memfit plan run.toml --budget 2GiB --out plan.json
    memfit plan --maximize batch_size --budget 256MiB    # the largest batch that fits
    memfit plan --maximize seq_len --budget 512MiB --levers all    # the longest sequence that fits
    memfit plan --budget device                           # what this device has room for
"""

from __future__ import annotations

import argparse

from memfit.app.build import run_precision
from memfit.applying import normalize_levers
from memfit.budget import Budget, format_bytes
from memfit.cli.common import config_from_args
from memfit.cli.model_args import batch_for, describe, optimizer_fn, run_device, spec_for
from memfit.errors import ConfigError
from memfit.outputs import check_output_file, marked_json, write_text
from memfit.planning.largest_batch import resize_batch
from memfit.planning.longest_sequence import resize_sequence
from memfit.planning.planner import plan
from memfit.records import Plan
from memfit.report.table import text_table
from memfit.step import Batch

__all__ = ["check", "plan_table", "run"]


def plan_table(result: Plan) -> str:
    """One row per block: its checkpointing mode (``segment k`` for a block in a segment)."""
    segment_of = {name: k for k, seg in enumerate(result.segments, 1) for name in seg}
    counts: dict[str, int] = {}
    rows = []
    for name, mode in result.blocks.items():
        shown = f"segment {segment_of[name]}" if name in segment_of else mode
        if name not in segment_of:
            counts[mode] = counts.get(mode, 0) + 1
        rows.append([name, shown])
    parts = [f"{n} {m}" for m, n in sorted(counts.items())]
    parts += [
        f"segment {k}: {len(seg)} blocks checkpointed as one" for k, seg in enumerate(result.segments, 1)
    ]
    return text_table(["block", "checkpointing"], rows) + f"\n({', '.join(parts)})"


def _answered_batch(batch: Batch, result: Plan, maximize: str | None) -> Batch:
    """The batch the plan was made for: ``batch`` resized to the answer of ``--maximize``."""
    if maximize == "batch_size":
        return resize_batch(batch, result.batch_size)
    if maximize == "seq_len":
        return resize_sequence(batch, result.seq_len)
    return batch


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def check(args: argparse.Namespace) -> None:
    """Refuse a bad config, budget, device or ``--out`` before the model is built; the budget,
    parsed here, is what :func:`run` plans to (``args.budget`` becomes a :class:`Budget`)."""
    cfg = config_from_args(args)
    args.budget = _budget(args, cfg.memory.budget)
    normalize_levers(args.levers)
    run_device(cfg)
    check_output_file(args.out, "--out")


def _budget(args: argparse.Namespace, configured: str) -> Budget:
    """``--budget``, else the config's ``memory.budget``, else ``"device"``, parsed (a Budget
    already parsed is returned as it is)."""
    given = args.budget if args.budget is not None else (configured or "device")
    return given if isinstance(given, Budget) else Budget.parse(given)


def run(args: argparse.Namespace) -> int:
    """Build the model, plan it under the budget, print the plan and write plan.json."""
    cfg = config_from_args(args)
    budget = _budget(args, cfg.memory.budget)
    precisions = args.precision or [run_precision(cfg)]
    device = run_device(cfg)
    spec = spec_for(cfg)
    model = spec.model.to(device)
    batch = batch_for(spec, cfg, device)
    opt = optimizer_fn(cfg)(model.parameters())
    blocks = args.blocks.split(",") if args.blocks else None
    choose = precisions[0] if len(precisions) == 1 else precisions
    result = plan(
        model, batch, spec.loss_fn, budget, opt, choose, check=not args.no_check, maximize=args.maximize,
        levers=args.levers, verify=args.verify, blocks=blocks,
    )  # fmt: skip
    try:
        write_text(args.out, marked_json("plan", result.to_dict()), "the plan")
    except ConfigError as exc:
        print(marked_json("plan", result.to_dict()), end="")  # See Note [the work is not lost]
        raise ConfigError(f"{str(exc).rstrip('.')}; the plan is printed above.") from None
    if args.json:
        print(result.to_json())
        return 0
    report = result.report
    print(
        f"{type(model).__name__} on {device}, batch "
        f"{describe(_answered_batch(batch, result, args.maximize))}: budget "
        f"{format_bytes(result.budget_bytes)}, fp32 no-checkpointing peak "
        f"{format_bytes(result.report.baseline_peak_bytes)}"
        + ("" if result.report.baseline_fits else " (under fake tensors: it does not fit here)")
    )
    print()
    print(plan_table(result))
    print()
    if args.maximize == "batch_size":
        print(f"batch size     {result.batch_size} (the largest that fits at this sequence length)")
    if args.maximize == "seq_len":
        print(f"sequence       {result.seq_len:,} tokens (the longest that fits at this batch size)")
    print(f"precision      {result.precision}")
    print(f"micro-batches  {result.micro_batches} (effective batch unchanged)")
    if result.levers:
        saved = ", ".join(f"{n} saves {format_bytes(b)}" for n, b in result.report.lever_savings.items())
        print(f"levers         {', '.join(result.levers)} ({saved})")
    print(
        f"peak           predicted {format_bytes(result.predicted_peak_bytes)} "
        f"({_ratio(result.predicted_peak_bytes, result.report.baseline_peak_bytes)} of the baseline)"
        + (f", measured {format_bytes(result.measured_peak_bytes)}" if result.measured_peak_bytes else "")
    )
    print(
        f"step time      predicted {_ratio(report.predicted_step_seconds, report.baseline_step_seconds)} "
        "of the baseline"
    )
    print(f"planned in     {result.report.planning_seconds:.1f} s, measuring:")
    for line in result.report.measured:
        print(f"  - {line}")
    for note in result.notes:
        print(f"note: {note}")
    print(f"plan written to {args.out}")
    return 0
