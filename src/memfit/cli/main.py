"""Entry point of the ``memfit`` command: dispatches to one module per subcommand.

Each subcommand module defines ``HELP`` (one line), ``add_arguments(parser)``,
``run(args) -> int`` and, when it takes inputs worth checking, ``check(args)``, which
validates every input (config, numbers, budgets, output paths) before any work starts.
User errors (:class:`memfit.errors.MemfitError`) are printed as one sentence and exit with
code 2; argparse usage errors also exit with 2 (one line, no usage dump). Nothing is ever
shown as a traceback: running out of memory and unexpected errors are one line too
(``MEMFIT_TRACEBACK=1`` shows the traceback of an unexpected error, for a bug report).

Example:
    >>> parse_args(["plan", "--budget", "-1GB"]).budget
    '-1GB'
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

import memfit
from memfit.errors import MemfitError, UsageError, is_out_of_memory

__all__ = ["main", "parse_args"]

_COMMANDS = ("doctor", "demo", "train", "estimate", "profile", "plan", "bench", "check")
#: A value that starts with a minus sign and a digit (``-1GB``): argparse takes it for an option.
_NEGATIVE = re.compile(r"^-\.?\d")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are :class:`UsageError`, never a usage dump and exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


@functools.cache
def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="memfit",
        description="Train PyTorch models in less memory: measure, plan, apply, run, report.",
    )
    parser.add_argument("--version", action="version", version=f"memfit {memfit.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for name in _COMMANDS:
        if importlib.util.find_spec(f"memfit.cli.{name}") is None:
            continue
        module = importlib.import_module(f"memfit.cli.{name}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _check=getattr(module, "check", None))
    return parser


def _join_negative_values(argv: Sequence[str]) -> list[str]:
    """``--budget -1GB`` -> ``--budget=-1GB``, so that the value reaches its check."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if token.startswith("--") and "=" not in token and nxt is not None and _NEGATIVE.match(nxt):
            out.append(f"{token}={nxt}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a command line (``--help`` prints and exits with 0).

    Raises:
        UsageError: the command line cannot be parsed; one sentence.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    return _parser().parse_args(_join_negative_values(args))


def _unexpected(command: str, exc: Exception) -> int:
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    if is_out_of_memory(exc):
        print(
            f"memfit {command}: error: out of memory ({first}); use a smaller batch or model, or a memory "
            "budget with checkpointing.",
            file=sys.stderr,
        )
        return 2
    print(
        f"memfit {command}: internal error: {type(exc).__name__}: {first}; this is a bug in memfit or in "
        "the model code: rerun with MEMFIT_TRACEBACK=1 to see where.",
        file=sys.stderr,
    )
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (argparse usage errors raise ``SystemExit(2)``)."""
    try:
        args = parse_args(argv)
    except UsageError as exc:
        print(f"memfit: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        if args._check is not None:
            args._check(args)
        return int(args._run(args))
    except MemfitError as exc:
        print(f"memfit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"memfit {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("MEMFIT_TRACEBACK"):
            raise
        return _unexpected(args.command, exc)


if __name__ == "__main__":
    sys.exit(main())
