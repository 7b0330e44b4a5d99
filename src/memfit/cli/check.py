"""``memfit check``: train fp32 and each mixed precision side by side and judge the difference."""

from __future__ import annotations

import argparse
from typing import cast

import torch

from memfit.app.build import build_model
from memfit.app.config import Config
from memfit.app.data import BatchSampler, ByteCorpus
from memfit.applying import check_plan_fits, normalize_levers
from memfit.check.stability import check_stability
from memfit.checkpointing import find_blocks
from memfit.cli.common import config_from_args, read_plan_file
from memfit.devices import resolve_device
from memfit.errors import ConfigError
from memfit.outputs import check_output_dir
from memfit.records import Plan, StabilityReport
from memfit.report.check_report import write_check_report
from memfit.step import Batch
from memfit.vocab import PrecisionName, normalize_modes, normalize_precision

__all__ = ["SMALL_MODEL", "check", "run"]

#: Without a config file the check trains this small built-in GPT (a minute or two on a CPU).
SMALL_MODEL = [
    "model.n_layer=2",
    "model.n_embd=64",
    "model.n_head=2",
    "model.block_size=32",
    "data.max_bytes=2000000",
]


def _plan(cfg: Config, model: torch.nn.Module, path: str | None) -> Plan | None:
    if path is not None:
        plan = read_plan_file(path)
        check_plan_fits(model, plan, levers=False)  # a plan for another model is refused at once
        return plan
    mode = cfg.memory.checkpointing
    if mode == "none":
        return None if cfg.train.grad_accum == 1 else Plan(blocks={}, micro_batches=cfg.train.grad_accum)
    if mode == "auto":
        raise ConfigError(
            'memory.checkpointing = "auto" needs a plan: run `memfit plan` and pass --plan plan.json.'
        )
    names = find_blocks(model)
    if mode.startswith("every:"):
        k = int(mode.split(":", 1)[1])
        blocks = {n: ("full" if i % k == 0 else "none") for i, n in enumerate(names)}
    else:
        blocks = dict.fromkeys(names, mode)
    return Plan(blocks=normalize_modes(blocks), micro_batches=cfg.train.grad_accum)


def _batches(cfg: Config, steps: int) -> tuple[list[Batch], list[Batch]]:
    spec = build_model(cfg.model)
    bs, seed = cfg.train.batch_size, cfg.train.seed
    if spec.make_batch is not None:
        train = [spec.random_batch(bs, seed=seed + i) for i in range(steps)]
        return train, [spec.random_batch(bs, seed=seed + steps + i) for i in range(cfg.train.eval_batches)]
    corpus = ByteCorpus.load(cfg.data.path, val_fraction=cfg.data.val_fraction, max_bytes=cfg.data.max_bytes)
    seq = spec.seq_len or cfg.model.block_size
    sampler = BatchSampler(corpus.train, bs, seq, seed)
    val = BatchSampler(corpus.val, bs, seq, seed)
    return [sampler.batch_at(i) for i in range(steps)], [
        val.batch_at(i) for i in range(cfg.train.eval_batches)
    ]


def _summary(report: StabilityReport) -> str:
    lines = [f"memfit check: {report.verdict} (noise band {report.noise_band:.4g})"]
    if report.levers:
        ref = report.reference.name if report.reference.name != "fp32" else "fp32, no lever"
        lines.append(f"  levers in the checked runs: {', '.join(report.levers)} (reference: {ref})")
    for pc in report.by_precision.values():
        lines.append(f"  {pc.precision}: {pc.verdict}")
        lines += [f"    - {r}" for r in pc.reasons]
    lines += [f"  {h}" for h in report.hardware if not h.startswith("note:")]
    return "\n".join(lines)


def _precisions(text: str) -> list[PrecisionName]:
    precisions = [p.strip() for p in text.split(",") if p.strip()]
    if not precisions:
        raise ConfigError("--precisions is empty; give bf16, fp16 or both, e.g. --precisions bf16,fp16.")
    return [cast(PrecisionName, normalize_precision(p)) for p in precisions]


def check(args: argparse.Namespace) -> None:
    """Refuse a bad config, device, precision list, step count, plan file or ``--out`` before training."""
    cfg = config_from_args(args, extra=SMALL_MODEL if args.config is None else None)
    _precisions(args.precisions)
    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}.")
    resolve_device(cfg.train.device)
    if args.plan is not None:
        read_plan_file(args.plan)
    normalize_levers(args.levers)
    check_output_dir(args.out or cfg.train.out, "--out")


def run(args: argparse.Namespace) -> int:
    """Run the check; exit 0 for PASS or WARN, 1 for FAIL (2 for bad input)."""
    cfg = config_from_args(args, extra=SMALL_MODEL if args.config is None else None)
    precisions = _precisions(args.precisions)
    torch.manual_seed(cfg.train.seed)
    spec = build_model(cfg.model)
    plan = _plan(cfg, spec.model, args.plan)
    train, evals = _batches(cfg, args.steps)

    def model_fn() -> torch.nn.Module:
        return build_model(cfg.model).model

    report = check_stability(
        model_fn,
        train,
        spec.loss_fn,
        cfg.optimizer.make,
        precisions=precisions,
        steps=args.steps,
        plan=plan,
        eval_batches=evals,
        device=resolve_device(cfg.train.device),
        clip_norm=cfg.optimizer.clip_norm or None,
        seed=cfg.train.seed,
        progress=False if args.quiet else None,
        levers=None if args.levers is None else normalize_levers(args.levers),
    )
    print(_summary(report))
    try:
        paths = write_check_report(report, args.out or cfg.train.out)
    except OSError as exc:
        print(report.to_json())  # See Note [the work is not lost]
        raise ConfigError(
            f"cannot write the check report to {str(args.out or cfg.train.out)!r} ({exc.strerror or exc}); "
            "the report is printed above."
        ) from None
    print(f"wrote {paths['md']}, {paths['json']}, {paths['png']}")
    return 1 if report.verdict == "FAIL" else 0
