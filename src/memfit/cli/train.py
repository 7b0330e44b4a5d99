"""``memfit train CONFIG.toml``: train as the config says, with metrics, a report and resume.

``memfit train --resume STATE`` needs no config file: the state holds the run's config, and
``--set`` options change it (``--resume STATE --set train.steps=400`` trains on for longer).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from memfit.app.resume import resolve_resume
from memfit.app.run import TrainRun, train_from_config
from memfit.app.setup import check_run
from memfit.cli.common import config_from_args, read_plan_file
from memfit.devices import resolve_device
from memfit.trainer.distributed import end_worker_process
from memfit.trainer.signals import exit_code

__all__ = ["check", "run"]


def _normalize(args: argparse.Namespace) -> None:
    if args.config is None and args.resume and args.resume.endswith(".toml"):
        # `memfit train --resume CONFIG.toml`: argparse gives the config to --resume.
        args.config, args.resume = args.resume, "auto"


def check(args: argparse.Namespace) -> None:
    """Refuse a bad config, device, output directory, plan file or missing state before anything
    is built; the plan, read here, is what :func:`run` trains with (``args.plan`` becomes a Plan)."""
    _normalize(args)
    cfg = config_from_args(args)
    if isinstance(args.plan, str):
        args.plan = read_plan_file(args.plan)
    if args.resume:
        resolve_resume(args.resume, Path(cfg.train.out))  # the state itself is read once, by run
        resolve_device(cfg.train.device)
    else:
        check_run(cfg, None, args.overwrite, plan=args.plan)


def _resume_line(args: argparse.Namespace, result: TrainRun) -> str:
    """One sentence after a stop signal: where the state is and the command that continues."""
    state = result.files.get("state", result.out / "state.pt")
    again = f"memfit train {args.config} --resume" if args.config else f"memfit train --resume {state}"
    return (
        f"memfit train: {result.trainer.stop_reason} after step {result.trainer.step_count}; its state is "
        f"saved in {str(state)!r}: continue with {again}"
    )


def run(args: argparse.Namespace) -> int:
    """Train; returns 0, or 128 + the signal after Ctrl-C (130), SIGTERM (143) or SIGHUP (129),
    with the state of the last finished step saved."""
    _normalize(args)
    cfg = config_from_args(args)
    result = train_from_config(
        cfg,
        resume=args.resume,
        progress=False if args.quiet else None,
        echo=(lambda _line: None) if args.quiet else print,
        overwrite=args.overwrite,
        overrides=list(args.overrides) if args.resume and args.config is None else None,
        plan=args.plan,
    )
    code = exit_code(result.trainer.stop_reason)
    if code and result.trainer.dist.is_main:
        print(_resume_line(args, result), file=sys.stderr)
    if result.trainer.dist.active and "TORCHELASTIC_RUN_ID" in os.environ:
        end_worker_process(code)  # a torchrun worker: see end_worker_process on why it exits early
    return code
