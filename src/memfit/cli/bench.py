"""``memfit bench``: measure memory against step time for every strategy, mark the front, draw it.

Takes the same CONFIG.toml and ``--set`` options as ``memfit train``; the batch is the
first training batch of the configured data (or the model's own batches). Writes
bench.md, bench.json, bench.csv and bench.png into ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memfit.app.build import build_model
from memfit.app.config import Config, read_toml
from memfit.app.data import BatchSampler, ByteCorpus
from memfit.benchmarking.copies import batch_to
from memfit.benchmarking.planned import planner_strategies
from memfit.benchmarking.report import bench_table, default_meta, failed_lines, write_bench_files
from memfit.benchmarking.strategies import builtin_strategies, resolve_strategies
from memfit.benchmarking.sweep import bench
from memfit.budget import Budget
from memfit.cli.advice import bench_advice
from memfit.cli.arguments import BENCH_DEFAULT_BATCH
from memfit.cli.common import config_from_args
from memfit.devices import device_facts, resolve_device
from memfit.errors import ConfigError
from memfit.outputs import check_output_dir
from memfit.records import BenchPoint

__all__ = ["check", "run"]


def _device(cfg: Config) -> torch.device:
    return resolve_device(cfg.train.device)


def _batch(cfg: Config, spec: Any, batch_size: int) -> Any:
    if spec.make_batch is None and spec.seq_len is not None:
        corpus = ByteCorpus.load(cfg.data.path, cfg.data.val_fraction, cfg.data.max_bytes)
        return BatchSampler(corpus.train, batch_size, spec.seq_len, seed=cfg.train.seed).batch_at(0)
    return spec.random_batch(batch_size, seed=cfg.train.seed)


def _configured_batch(args: argparse.Namespace) -> bool:
    """Whether the config file or a ``--set`` names ``train.batch_size``."""
    if any(o.replace(" ", "").startswith("train.batch_size=") for o in args.overrides):
        return True
    if args.config:
        train = read_toml(args.config).get("train", {})
        return isinstance(train, dict) and "batch_size" in train
    return False


def _check_budget(text: Budget | str | None) -> None:
    """Refuse a malformed budget before minutes of measuring (a percentage is resolved later)."""
    if text is not None:
        Budget.parse(text, what="--budget")


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run, for the files' headers."""
    parts = ["memfit", "bench"] + ([args.config] if args.config else [])
    parts += [f"--set={o}" for o in args.overrides]
    parts += [f"--strategies={s}" for s in args.strategies]
    for flag in ("budget", "plan", "out", "steps", "slow_steps", "batch_size", "threads"):
        value = getattr(args, flag)
        if value is not None:
            parts.append(f"--{flag.replace('_', '-')}={value}")
    return " ".join(shlex.quote(p) for p in parts)


def _names(args: argparse.Namespace) -> list[str] | None:
    return [n.strip() for item in args.strategies for n in item.split(",") if n.strip()] or None


def check(args: argparse.Namespace) -> None:
    """Refuse bad numbers, budgets, strategies, config, device or ``--out`` before anything is built."""
    if args.list:
        return
    for flag, value in (("--steps", args.steps), ("--slow-steps", args.slow_steps)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}.")
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}.")
    if args.threads is not None and args.threads < 0:
        raise ConfigError(f"--threads must be 0 or more, got {args.threads}.")
    _check_budget(args.budget)
    for b in [b.strip() for b in (args.plan or "").split(",") if b.strip()]:
        Budget.parse(b, what="--plan budget")
    cfg = config_from_args(args)
    check_output_dir(args.out or cfg.train.out, "--out")
    resolve_strategies(_names(args))  # unknown names fail before anything is built
    _device(cfg)
    _configured_batch(args)


def _optimizer_fn(cfg: Config) -> Callable[[Any], torch.optim.Optimizer]:
    """AdamW with the config's settings."""
    return cfg.optimizer.make


def _with_plans(
    names: list[str] | None,
    plan_budgets: list[str],
    spec: Any,
    batch: Any,
    device: torch.device,
    cfg: Config,
) -> list[Any] | None:
    """The strategies to bench: ``names`` plus the planner's plan at each budget (``--plan``)."""
    if not plan_budgets:
        return names
    # the planner runs on its own copy on the bench's device; its points then run side by
    # side with the built-in strategies, interleaved like them
    planned = copy.deepcopy(spec.model).to(device)
    extra = planner_strategies(
        planned,
        batch_to(batch, device),
        spec.loss_fn,
        _optimizer_fn(cfg)(planned.parameters()),
        plan_budgets,
        cfg.memory.precision,
    )
    for b in [b for b in plan_budgets if f"plan@{b}" not in {s.name for s in extra}]:
        print(f"memfit bench: no plan fits {b}; no plan@{b} point.", file=sys.stderr)
    del planned
    return [*(names or [s.name for s in builtin_strategies()]), *extra]


def _budget(args: argparse.Namespace, points: list[BenchPoint]) -> int | None:
    """``--budget`` in bytes (a percentage of the baseline's peak), or None."""
    if args.budget is None:
        return None
    budget = Budget.parse(args.budget, "--budget")
    base = next((p for p in points if p.ok and p.strategy == p.baseline), None)
    if budget.is_fraction and base is None:
        # the table of what did run is still worth printing and writing: warn, compare with no budget
        failed = next((p for p in points if p.strategy == p.baseline), None)
        why = f" ({failed.error})" if failed is not None and failed.error else " (it was not benched)"
        print(
            f"memfit bench: --budget {args.budget} is a percentage of the baseline's peak, but the "
            f"baseline did not run{why}; the results below are shown without a budget.",
            file=sys.stderr,
        )
        return None
    return budget.resolve(base.peak_bytes if base else None, "--budget")


def _print_points(points: list[BenchPoint], budget: int | None, heading: str, device: torch.device) -> None:
    print(heading)
    print(bench_table(points))
    failed = failed_lines(points)
    if failed:
        print("\nstrategies that could not run:")
        for line in failed:
            print(f"  {line}")
    print("\n" + bench_advice(points, budget, device_facts(device)))


def _write(
    args: argparse.Namespace, points: list[BenchPoint], budget: int | None, device: torch.device, model: str
) -> None:
    """bench.md, bench.json, bench.csv and bench.png in ``--out``, with what made them."""
    cfg = config_from_args(args)
    out = Path(args.out or cfg.train.out)
    meta = default_meta(str(device), _command(args), device_facts(device).description)
    meta["torch"] = torch.__version__
    meta["model"] = model
    meta["timed steps"] = f"{args.steps} ({args.slow_steps} for precisions this device emulates)"
    meta["torch threads"] = torch.get_num_threads()
    try:
        advice = bench_advice(points, budget, device_facts(device))
        paths = write_bench_files(points, out, budget, meta, advice)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the bench files to {str(out)!r} ({exc.strerror or exc}); "
            "the table is printed above."
        ) from None
    print(f"wrote {', '.join(str(p) for p in paths.values())}")


def run(args: argparse.Namespace) -> int:
    """Build the model, bench the strategies, print the table and write the files."""
    if args.list:
        for s in builtin_strategies():
            print(s.name)
        return 0
    cfg = config_from_args(args)
    device = _device(cfg)
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else 0)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(cfg.train.seed)
    spec = build_model(cfg.model)
    # See Note [the bench's default batch]
    batch_size = args.batch_size or (cfg.train.batch_size if _configured_batch(args) else BENCH_DEFAULT_BATCH)
    batch = _batch(cfg, spec, batch_size)
    plan_budgets = [b.strip() for b in (args.plan or "").split(",") if b.strip()]
    points = bench(
        spec.model,
        batch,
        spec.loss_fn,
        _optimizer_fn(cfg),
        strategies=_with_plans(_names(args), plan_budgets, spec, batch, device, cfg),
        steps=args.steps,
        slow_steps=args.slow_steps,
        device=device,
        seed=cfg.train.seed,
        progress=False if args.quiet else None,
    )
    budget = _budget(args, points)
    params = sum(p.numel() for p in spec.model.parameters())
    heading = (
        f"memfit bench on {device}: {params:,} parameters, batch {batch_size}, {args.steps} timed "
        f"steps each ({args.slow_steps} for precisions this device emulates)"
    )
    _print_points(points, budget, heading, device)
    _write(args, points, budget, device, f"{cfg.model.name} ({params:,} parameters), batch {batch_size}")
    return 0
