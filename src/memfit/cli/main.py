"""Entry point of the ``memfit`` command: dispatches to one module per subcommand.

Each subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. User errors (:class:`memfit.errors.MemfitError`) are printed as one
sentence and exit with code 2; argparse usage errors also exit with 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

import memfit
from memfit.errors import MemfitError

__all__ = ["main"]

_COMMANDS = ("doctor", "demo", "train", "estimate", "profile", "plan", "bench", "check")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memfit",
        description="Train PyTorch models in less memory: measure, plan, apply, run, report.",
    )
    parser.add_argument("--version", action="version", version=f"memfit {memfit.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMANDS:
        if importlib.util.find_spec(f"memfit.cli.{name}") is None:
            continue
        module = importlib.import_module(f"memfit.cli.{name}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        return int(args._run(args))
    except MemfitError as exc:
        print(f"memfit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"memfit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
