"""Bench strategies: a name, a precision, and how to prepare a fresh model copy.

A strategy is data plus one function: ``prepare(model, batch, loss_fn) -> model`` changes a
fresh copy of the user's model (checkpointing it, routing it through
``checkpoint_sequential``, applying a plan) and returns it; ``precision`` says what the
step runs in and ``micro_batches`` how the batch is split. New strategies (the planner's
``plan@budget``) are one :class:`Strategy` each, passed to :func:`memfit.bench` next to the
built-in ones.

A planner strategy, for instance, is::

    plan = memfit.plan(model, batch, loss_fn, budget="2GiB")
    Strategy(name="plan@2GiB", precision=plan.precision, checkpointing="plan",
             prepare=lambda m, b, f: memfit.apply(m, plan), micro_batches=plan.micro_batches)

Built-in names are ``PRECISION/CHECKPOINTING`` with precision in fp32, bf16, fp16 and
checkpointing in none, full (every block), every2 (every 2nd block), sequential
(``checkpoint_sequential`` with sqrt(n) segments) and selective.

Example:
    >>> [s.name for s in resolve_strategies(["fp32/none", "bf16/*"])]
    ['fp32/none', 'bf16/none', 'bf16/full', 'bf16/every2', 'bf16/sequential', 'bf16/selective']
    >>> resolve_strategies(["fp32/ful"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    memfit.errors.ConfigError: unknown strategy 'fp32/ful' (did you mean 'fp32/full'?); valid: ...
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from memfit.benchmarking.sequential import install_sequential
from memfit.checkpointing import checkpoint
from memfit.errors import ConfigError
from memfit.step import Batch, LossFn
from memfit.vocab import PRECISIONS, CheckpointMode, PrecisionName

__all__ = [
    "BENCH_CHECKPOINTING",
    "BENCH_PRECISIONS",
    "Strategy",
    "builtin_strategies",
    "builtin_strategy",
    "resolve_strategies",
]

BENCH_PRECISIONS: tuple[PrecisionName, ...] = PRECISIONS
BENCH_CHECKPOINTING: tuple[str, ...] = ("none", "full", "every2", "sequential", "selective")

Prepare = Callable[[nn.Module, Batch, LossFn], nn.Module]


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """One way to run a training step, measured side by side with the others."""

    name: str
    """Unique name shown in tables, e.g. ``"bf16/full"`` or ``"plan@2GiB"``."""
    precision: PrecisionName
    """``"fp32"``, ``"bf16"`` or ``"fp16"``."""
    checkpointing: str
    """A short label of what ``prepare`` does: none, full, every2, sequential, selective, plan."""
    prepare: Prepare
    """``prepare(model_copy, batch, loss_fn) -> model``: change the fresh copy, return it."""
    micro_batches: int = 1
    """Split the batch into this many micro-batches with gradient accumulation."""


def _plain(model: nn.Module, batch: Batch, loss_fn: LossFn) -> nn.Module:
    return model


def _checkpointed(
    mode: CheckpointMode, every: int, model: nn.Module, batch: Batch, loss_fn: LossFn
) -> nn.Module:
    return checkpoint(model, mode=mode, every=every)


def _sequential(model: nn.Module, batch: Batch, loss_fn: LossFn) -> nn.Module:
    return install_sequential(model, loss_fn, batch)


_PREPARE: dict[str, Prepare] = {
    "none": _plain,
    "full": functools.partial(_checkpointed, "full", 1),
    "every2": functools.partial(_checkpointed, "full", 2),
    "sequential": _sequential,
    "selective": functools.partial(_checkpointed, "selective", 1),
}


def builtin_strategy(precision: PrecisionName, checkpointing: str) -> Strategy:
    """The built-in strategy ``precision/checkpointing``."""
    return Strategy(
        name=f"{precision}/{checkpointing}",
        precision=precision,
        checkpointing=checkpointing,
        prepare=_PREPARE[checkpointing],
    )


def builtin_strategies() -> list[Strategy]:
    """All built-in strategies: every precision with every checkpointing, fp32 first."""
    return [builtin_strategy(p, c) for p in BENCH_PRECISIONS for c in BENCH_CHECKPOINTING]


def resolve_strategies(specs: Iterable[str | Strategy] | None) -> list[Strategy]:
    """Turn names, patterns (``"bf16/*"``, ``"*/full"``, ``"all"``) and Strategy objects into strategies.

    Duplicates are dropped (first one wins); order follows ``specs``.

    Raises:
        ConfigError: a name or pattern matches no built-in strategy, or no strategy is left.
    """
    known = builtin_strategies()
    by_name = {s.name: s for s in known}
    out: dict[str, Strategy] = {}
    for spec in known if specs is None else specs:
        if isinstance(spec, Strategy):
            out.setdefault(spec.name, spec)
            continue
        if not isinstance(spec, str):
            raise ConfigError(f"a strategy must be a name or a Strategy, got {type(spec).__name__}.")
        text = spec.strip()
        matches = list(by_name) if text == "all" else fnmatch.filter(by_name, text)
        if not matches:
            close = difflib.get_close_matches(text, list(by_name), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown strategy {text!r}{hint}; valid: {', '.join(by_name)}, a pattern such as "
                "'bf16/*' or '*/full', or 'all'."
            )
        for name in matches:
            out.setdefault(name, by_name[name])
    if not out:
        raise ConfigError("no strategies to bench; name at least one, e.g. 'fp32/none'.")
    return list(out.values())
