"""The config that a subcommand's ``CONFIG.toml`` and ``--set`` options name."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping

from memfit.app.config import Config, load_config
from memfit.errors import ConfigError
from memfit.reading import read_bounded
from memfit.records import Plan

__all__ = ["MAX_PLAN_BYTES", "config_from_args", "read_plan_file", "zero_grads_note"]

#: The largest plan file read (a plan is kilobytes; a profile-sized one, megabytes).
MAX_PLAN_BYTES = 64 * 2**20

# Note [the work is not lost]
# A command that cannot write its output file (a full disk, a directory it may not write)
# has already spent minutes measuring: it prints what it made to stdout first, then fails
# with one sentence (exit 2), so nothing already computed is lost.


def config_from_args(args: argparse.Namespace, extra: list[str] | None = None) -> Config:
    """Load the config named by the arguments, with ``extra`` overrides applied first.

    The config is read once per command line: a command's ``check`` and ``run`` share it.
    """
    cached = getattr(args, "_config", None)
    if isinstance(cached, Config):
        return cached
    cfg = load_config(getattr(args, "config", None), [*(extra or []), *args.overrides])
    args._config = cfg
    return cfg


def read_plan_file(path: str) -> Plan:
    """The plan in ``path`` (a ``plan.json`` ``memfit plan`` wrote, today's or an older one's).

    Raises:
        ConfigError: the file cannot be read or is not a memfit plan (one sentence).
    """
    data = read_bounded(path, "plan file", MAX_PLAN_BYTES, hint="give the path of a plan.json.")
    try:
        return Plan.from_json(data.decode("utf-8"))
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"plan file {path!r} is not a memfit plan: {str(exc).rstrip('.')}.") from None


def zero_grads_note(breakdowns: Iterable[Mapping[str, int]]) -> str | None:
    """Why a breakdown shows no gradient bytes (said under its table), or None when all show some.

    Example:
        >>> zero_grads_note([{"params": 8, "grads": 0}])[:14]
        'gradients 0 B:'
    """
    if all(b.get("grads", 0) > 0 for b in breakdowns):
        return None
    return (
        "gradients 0 B: the peak comes before the backward makes any gradient (the last step's were "
        "freed by zero_grad(set_to_none=True); fused_step frees each at once)"
    )
