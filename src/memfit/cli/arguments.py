"""Every subcommand's arguments and one-line help, defined without importing torch.

``memfit --help``, ``memfit <cmd> --help`` and a command line argparse refuses are
answered from this module alone, in a fraction of a second; the module that does a
command's work (``memfit.cli.<cmd>``, with torch and the rest of memfit) is imported only
when the command runs. See Note [a light command line].

Example:
    >>> COMMANDS["plan"].help.startswith("plan per-block checkpointing")
    True
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BENCH_DEFAULT_BATCH", "COMMANDS", "Command", "add_config_arguments", "add_quiet_argument"]

# Note [a light command line]
# Importing torch takes seconds; a user who asks for --help, --version or mistypes an option
# should not wait for it. This module imports only the standard library: no memfit module
# (memfit.errors and memfit.vocab import torch), so names with choices (precisions, modes)
# are checked by a converter that reads memfit.vocab only once such an option is given, and
# their help names them in words. tests/test_cli_fast.py checks that these words and
# memfit.vocab agree, and that no torch is imported for help, the version or a bad option.

# Note [the bench's default batch]
# The bench runs every strategy several times, bf16/fp16 emulated on most CPUs; a modest
# default batch keeps a default run to a couple of minutes. Ratios between strategies
# change little with the batch; a batch set in the config or by --set is used.

#: The bench's batch when neither the config nor ``--set`` names one.
BENCH_DEFAULT_BATCH = 4


@dataclass(frozen=True)
class Command:
    """One subcommand: its help line and the function that adds its arguments."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]


def _vocabulary(name: str) -> tuple[str, ...]:
    import memfit.vocab  # See Note [a light command line]

    names: tuple[str, ...] = getattr(memfit.vocab, name)
    return names


def _one_of(vocabulary: str) -> Callable[[str], str]:
    """An argparse ``type`` accepting the names of ``memfit.vocab.<vocabulary>``."""

    def convert(text: str) -> str:
        names = _vocabulary(vocabulary)
        if text not in names:
            raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(names)})")
        return text

    convert.__name__ = vocabulary.lower()
    return convert


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


def add_quiet_argument(
    parser: argparse.ArgumentParser, what: str = "no progress bar or progress lines"
) -> None:
    """``--quiet``: the command sets ``MEMFIT_QUIET=1`` while it runs (memfit.cli.main)."""
    parser.add_argument("--quiet", action="store_true", help=what)


def _levers(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument("--levers", default=None, metavar="NAMES", help=help_text)


def _blocks(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--blocks",
        metavar="NAMES",
        help="the blocks to plan: comma-separated module names or a class name (default: the repeated "
        "blocks memfit.find_blocks finds)",
    )


def _plan(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--budget",
        metavar="60%|6GiB|device",
        help="peak memory of one training step: '60%%' of the fp32 no-checkpointing peak, a size "
        "('2GiB', '500MB', bytes), or 'device' (what the device has room for now, less a margin; "
        "the default when neither this nor memory.budget of the config is given)",
    )
    parser.add_argument(
        "--precision",
        nargs="+",
        type=_one_of("PRECISION_CHOICES"),
        metavar="PRECISION",
        help="precision(s) to choose from: fp32, bf16, fp16 or auto (default: memory.precision of the "
        "config; auto: fp32 and what the device runs natively, as memfit.plan in Python)",
    )
    parser.add_argument(
        "--maximize",
        type=_one_of("MAXIMIZE"),
        metavar="batch_size|seq_len",
        help="batch_size: find the largest batch (at the configured sequence length) that a plan fits "
        "without micro-batches, starting from train.batch_size; seq_len: the longest sequence (at the "
        "configured batch size) that a plan fits, with --levers if given",
    )
    _levers(
        parser, "levers beyond activations the plan may use: comma-separated names or 'all' (default none)"
    )
    parser.add_argument("--verify", action="store_true", help="check the chosen levers against fp32")
    _blocks(parser)
    parser.add_argument("--out", metavar="FILE", default="plan.json", help="where to write the plan")
    parser.add_argument("--no-check", action="store_true", help="do not measure the chosen plan")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_quiet_argument(parser)


def _bench(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--strategies",
        action="append",
        default=[],
        metavar="NAMES",
        help="comma-separated strategy names or patterns (fp32/none, bf16/*, */full, all; default all); "
        "see --list",
    )
    parser.add_argument(
        "--budget",
        metavar="60%|6GiB",
        help="answer 'what fits in this budget?': e.g. 60%% (of fp32/none's peak), 2GiB, 500MB",
    )
    parser.add_argument(
        "--out", metavar="DIR", help="directory for bench.md/json/csv/png (default: train.out)"
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="timed steps per strategy, interleaved (default 5)"
    )
    parser.add_argument(
        "--slow-steps",
        type=int,
        default=1,
        help="timed steps for precisions the device only emulates (bf16/fp16 on most CPUs; default 1)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        help="sequences per step (default: train.batch_size if the config or --set gives it, else "
        f"{BENCH_DEFAULT_BATCH})",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads for torch (default 1 on a CPU: single-threaded times are steadier on a "
        "shared machine; 0 keeps torch's default)",
    )
    parser.add_argument(
        "--plan",
        metavar="BUDGETS",
        help="also bench the planner's plan at each budget, e.g. '50%%,65%%,80%%' (points plan@BUDGET)",
    )
    parser.add_argument("--list", action="store_true", help="list the built-in strategies and exit")
    add_quiet_argument(parser)


def _check(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.epilog = (
        "Without CONFIG.toml: a 2-layer, 64-wide built-in GPT on 32-byte windows of Python's own "
        "source (--set overrides apply on top)."
    )
    parser.add_argument(
        "--precisions",
        default="bf16,fp16",
        help="comma-separated modes to check against fp32 (default bf16,fp16)",
    )
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    parser.add_argument("--out", default=None, help="output directory (default: train.out of the config)")
    parser.add_argument("--plan", default=None, help="a plan.json whose checkpointing the mixed runs use")
    _levers(
        parser, "levers the checked runs use (comma-separated names or 'all'; default: the plan's, else none)"
    )
    add_quiet_argument(parser)


def _demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--steps", type=int, default=250, help="training steps of the memfit run (default 250)"
    )
    parser.add_argument(
        "--baseline-steps", type=int, default=10, help="steps of the baseline, run side by side (default 10)"
    )
    parser.add_argument("--out", default="memfit-out/demo", help="output directory (default memfit-out/demo)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: torch's, or the cores other processes leave free where fewer)",
    )
    add_quiet_argument(parser)
    parser.add_argument(
        "--budget",
        default="60%",
        metavar="60%|6GiB",
        help="memory budget the planner fits the memfit run to (default 60%% of the baseline's peak)",
    )


def _doctor(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")


def _estimate(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="memory of the device you will train on, e.g. 24GiB or 80GB; the last line says what fits",
    )
    parser.add_argument(
        "--precision",
        action="append",
        type=_one_of("PRECISIONS"),
        metavar="PRECISION",
        help="estimate only this precision: fp32, bf16 or fp16 (repeatable; default all three)",
    )
    _levers(
        parser,
        "also print the smallest step these levers allow (comma-separated names or 'all'); with "
        "--maximize seq_len, the levers the longest sequence may use",
    )
    parser.add_argument(
        "--maximize",
        type=_one_of("MAXIMIZE"),
        metavar="seq_len",
        help="seq_len: the longest sequence (at the configured batch size) whose step fits --device-memory, "
        "with no levers, with --levers but offload, and with offload too if --levers allows it",
    )
    parser.add_argument(
        "--grain",
        type=int,
        metavar="TOKENS",
        help="with --maximize seq_len: lengths searched are multiples of this (default 1024)",
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        metavar="TOKENS",
        help="with --maximize seq_len: the longest length searched (default: what the model's position "
        "table takes, else 16,777,216)",
    )
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    add_quiet_argument(parser)


def _profile(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--precision",
        type=_one_of("PRECISION_CHOICES"),
        metavar="PRECISION",
        help="fp32, bf16, fp16 or auto (default: memory.precision of the config)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per mode (default 3)")
    _blocks(parser)
    parser.add_argument("--device-memory", metavar="SIZE", help="memory to compare against, e.g. 24GiB")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")
    parser.add_argument("--out", metavar="FILE", help="also write the profile as JSON to FILE")
    add_quiet_argument(parser)


def _train(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="STATE",
        help="continue from a saved training state (default: state.pt in train.out); the state "
        "holds the run's config, --set changes it",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="start a new run even if train.out already holds one"
    )
    parser.add_argument(
        "--plan",
        metavar="PLAN.json",
        help="train with this plan (what memfit plan wrote) as it is, without planning again: its "
        "checkpointing, precision, micro-batches and levers; refused if made for another model, batch "
        "or device",
    )
    add_quiet_argument(parser, "no progress bar and no per-evaluation lines")


#: The subcommands in the order ``memfit --help`` lists them.
COMMANDS: dict[str, Command] = {
    "doctor": Command(
        "show devices, memory, precision support and checkpointing features, with a recommendation", _doctor
    ),
    "demo": Command(
        "train the built-in GPT on Python's own source: the baseline, then in less memory", _demo
    ),
    "train": Command(
        "train a model from a TOML config: metrics.jsonl, report.md and a resumable state.pt", _train
    ),
    "estimate": Command(
        "predict peak memory for every precision x checkpointing mode with fake tensors (no allocation)",
        _estimate,
    ),
    "profile": Command(
        "profile each block's kept memory, backward peak, time and FLOPs under none/selective/full", _profile
    ),
    "plan": Command(
        "plan per-block checkpointing, precision and micro-batches to fit a memory budget", _plan
    ),
    "bench": Command(
        "measure peak memory and step time of every precision x checkpointing strategy, side by side", _bench
    ),
    "check": Command(
        "compare bf16/fp16 training against fp32 (noise band, overflow attribution): PASS, WARN or FAIL",
        _check,
    ),
}
