"""What the command line checks before torch is imported: the config path, budgets and ``--out``.

Importing torch takes seconds; a mistyped path, budget or output directory should cost a
fraction of one (See Note [a light command line] in :mod:`memfit.cli.arguments`). These
checks use only modules that import no torch (:mod:`memfit.budget`, :mod:`memfit.reading`,
:mod:`memfit.outputs`; See Note [errors without torch]); each command's own ``check`` then
validates the rest once torch is there. A budget is parsed here once, into a
:class:`memfit.budget.Budget` that replaces the text in ``args.budget`` and is handed on.

Example:
    >>> import argparse
    >>> args = argparse.Namespace(command="plan", config=None, budget="60%", out="plan.json")
    >>> check_early(args, ["plan", "--budget", "60%"])
    >>> args.budget
    Budget(bytes=None, fraction=0.6, text='60%', device=False)
    >>> args = argparse.Namespace(command="plan", config="potatoes", budget="5", out="plan.json")
    >>> check_early(args, ["plan", "--budget", "5", "potatoes"])
    Traceback (most recent call last):
    ...
    memfit.errors.ConfigError: cannot read --budget '5 potatoes': write bytes as an integer, ...
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

from memfit.budget import Budget
from memfit.errors import ConfigError
from memfit.outputs import check_output_dir, check_output_file
from memfit.reading import read_bounded

__all__ = ["check_early"]

#: Options whose value is a size, which a shell splits in two when it is written with a space
#: (``--budget 5 GiB``): the second word then lands where the config path goes.
_SIZES = ("--budget", "--device-memory")
#: Where ``--out`` is a file (the others write a directory).
_OUT_FILE = {"plan", "profile"}
_HINT = "give the path of a TOML file."
_NUMBER = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)")
#: A word that can only be a unit, never a path: letters alone, or ``%``.
_UNIT_LIKE = re.compile(r"[A-Za-z]+|%")


def check_early(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """Check ``args``' config path, budget and ``--out`` (parsing the budget into a ``Budget``).

    Args:
        args: the parsed command line.
        argv: the words it was parsed from (to tell a size split in two from a config path).

    Raises:
        ConfigError: one sentence naming the argument: a config that is not a readable file, a
            budget or size that cannot be read (a size written as two words is named whole),
            an ``--out`` that cannot be written.
    """
    _check_config(args, argv)
    if getattr(args, "budget", None) is not None:
        args.budget = Budget.parse(args.budget, what="--budget")
    out = getattr(args, "out", None)
    if out:
        check = check_output_file if args.command in _OUT_FILE else check_output_dir
        check(out, "--out")


def _check_config(args: argparse.Namespace, argv: Sequence[str]) -> None:
    config = getattr(args, "config", None)
    if config is None:
        return
    try:
        read_bounded(config, "config file", 1, whole=False, hint=_HINT)
    except ConfigError:
        split = _split_size(argv, config)
        if split is not None:
            _refuse_split(*split)
        raise


def _split_size(argv: Sequence[str], config: str) -> tuple[str, str, str] | None:
    """``(option, number, config)`` when ``config`` is a word of letters (or ``%``) right after a
    size option's bare number in ``argv``: a size written as two words (``--budget 5 GiB``)."""
    if not _UNIT_LIKE.fullmatch(config):
        return None
    words = list(argv)
    for i in range(len(words) - 2):
        if words[i] in _SIZES and _NUMBER.fullmatch(words[i + 1]) and words[i + 2] == config:
            return words[i], words[i + 1], config
    return None


def _refuse_split(option: str, value: str, word: str) -> None:
    """Refuse ``--budget 5 GiB`` naming the budget: as it reads whole, or why it cannot be read."""
    whole = f"{value} {word}"
    Budget.parse(whole, what=option)  # a size that cannot be read is refused here, by name
    raise ConfigError(
        f"{option} {whole!r} is two words on the command line, so {word!r} was taken for the config "
        f"file; write it as one word ({option} {value}{word}) or in quotes."
    )
