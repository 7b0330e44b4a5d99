"""Options shared by the subcommands that take a model: a config file and ``--set`` overrides."""

from __future__ import annotations

import argparse

from memfit.app.config import Config, load_config

__all__ = ["add_config_arguments", "config_from_args"]

# Note [the work is not lost]
# A command that cannot write its output file (a full disk, a directory it may not write)
# has already spent minutes measuring: it prints what it made to stdout first, then fails
# with one sentence (exit 2), so nothing already computed is lost.


def add_config_arguments(parser: argparse.ArgumentParser, config_required: bool = False) -> None:
    """Add ``CONFIG`` (a TOML file) and ``--set section.key=value`` (repeatable)."""
    parser.add_argument(
        "config",
        nargs=None if config_required else "?",
        metavar="CONFIG.toml",
        help="run configuration (TOML); defaults apply where it is silent",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set model.n_layer=8 (repeatable)",
    )


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
