"""The config that a subcommand's ``CONFIG.toml`` and ``--set`` options name."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping

from memfit.app.config import Config, load_config

__all__ = ["config_from_args", "zero_grads_note"]

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
