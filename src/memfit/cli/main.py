"""Entry point of the ``memfit`` command: dispatches to one module per subcommand.

The parser is built from :mod:`memfit.cli.arguments` (each subcommand's arguments and help,
without torch); a subcommand's own module, ``memfit.cli.<cmd>``, is imported only when it
runs. That module defines ``run(args) -> int`` and, when it takes inputs worth checking,
``check(args)``, which validates every input (config, numbers, budgets, output paths)
before any work starts; the config path, the budget (parsed once, into a ``Budget``) and
``--out`` are checked even before that, without torch (:mod:`memfit.cli.inputs`). User
errors (:class:`memfit.errors.MemfitError`) are printed as one sentence and exit with code
2; argparse usage errors also exit with 2 (one line, no usage dump). Nothing is ever shown
as a traceback: running out of memory and unexpected errors are one line too
(``MEMFIT_TRACEBACK=1`` shows the traceback of an unexpected error, for a bug report).
``--quiet`` sets ``MEMFIT_QUIET=1`` while the command runs, which every progress report of
memfit honours; ``-v`` sets ``MEMFIT_VERBOSE=1``, which lets through what dependencies print
and memfit holds back (:mod:`memfit.levers.quiet`).

Example:
    >>> parse_args(["plan", "--budget", "-1GB"]).budget
    '-1GB'
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import re
import sys
from collections.abc import Iterator, Sequence
from typing import NoReturn

import memfit
from memfit.cli.arguments import COMMANDS

__all__ = ["main", "parse_args"]

#: A value that starts with a minus sign and a digit (``-1GB``): argparse takes it for an option.
_NEGATIVE = re.compile(r"^-\.?\d")


class _BadCommandLine(Exception):
    """What argparse refused, in one sentence; raised before anything imports torch."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one sentence, never a usage dump and exit."""

    def error(self, message: str) -> NoReturn:
        raise _BadCommandLine(f"{message} (see {self.prog} --help)")


class _Step:
    """``check`` or ``run`` of ``memfit.cli.<command>``, imported when first called."""

    def __init__(self, command: str, step: str) -> None:
        self.command, self.step = command, step

    def __call__(self, args: argparse.Namespace) -> int | None:
        module = importlib.import_module(f"memfit.cli.{self.command}")
        fn = getattr(module, self.step, None)
        return None if fn is None else fn(args)


@functools.cache
def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="memfit",
        description="Train PyTorch models in less memory: measure, plan, apply, run, report.",
    )
    parser.add_argument("--version", action="version", version=f"memfit {memfit.__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also show what dependencies print that memfit holds back (torchao's kernels that did not "
        "load, deprecation lines)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(_run=_Step(name, "run"), _check=_Step(name, "check"))
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


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    args = list(sys.argv[1:] if argv is None else argv)
    return _parser().parse_args(_join_negative_values(args))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a command line (``--help`` prints and exits with 0).

    Raises:
        UsageError: the command line cannot be parsed; one sentence.
    """
    try:
        return _parse(argv)
    except _BadCommandLine as exc:
        from memfit.errors import UsageError

        raise UsageError(str(exc)) from None


def _unexpected(command: str, exc: Exception) -> int:
    from memfit.errors import is_out_of_memory

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


@contextlib.contextmanager
def _env_set(on: bool, name: str = "MEMFIT_QUIET") -> Iterator[None]:
    """``name=1`` while the command runs (``MEMFIT_QUIET`` for ``--quiet``, ``MEMFIT_VERBOSE`` for
    ``-v``); the variable is restored after."""
    before = os.environ.get(name)
    if on:
        os.environ[name] = "1"
    try:
        yield
    finally:
        if on and before is None:
            os.environ.pop(name, None)
        elif on and before is not None:
            os.environ[name] = before


def _run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    from memfit import progress  # imports no torch
    from memfit.cli.inputs import check_early  # imports no torch
    from memfit.errors import MemfitError

    try:
        quiet, verbose = bool(getattr(args, "quiet", False)), bool(getattr(args, "verbose", False))
        with _env_set(quiet), _env_set(verbose, "MEMFIT_VERBOSE"):
            check_early(args, argv)  # the config path, budget and --out, before torch
            with progress.starting(f"{args.command}: importing torch and setting up"):
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (argparse usage errors raise ``SystemExit(2)``)."""
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parse(words)
    except _BadCommandLine as exc:
        print(f"memfit: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return _run(args, words)


if __name__ == "__main__":
    sys.exit(main())
