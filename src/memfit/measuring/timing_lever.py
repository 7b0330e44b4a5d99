"""The lever whole steps may be timed with (:class:`TimingLever`), made by the planner and
used by :class:`memfit.measuring.profile.Profiler`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from memfit.records import Profile

__all__ = ["TimingLever"]

# Note [timing with a lever]
# Where a search's answer is planned (``within`` set), no step without levers may fit the
# budget at all: at 40k tokens a small Llama's plain loss head alone is gigabytes of
# logits, whatever the blocks do. Timed in the room instead, such a step takes most of the
# machine (and was killed for it); and where the device itself cannot hold it, no step
# could be timed although a plan with levers fits. So the planner may hand the profiler a
# lever to time with (``lean``: the loss head in chunks, when the request allows
# chunked_loss and the model's loss goes through its head), tried after the configurations
# without it: within the budget without it, then with it, then the room with it, and only
# then the room without it (no budget to keep within: the room without it, then with it).
# The lever changes no numerics and no counted work; it moves the head's gradient matmuls
# from the backward into the forward (``moved_flops``), which the time fit moves back
# (memfit/measuring/prices.py), so the seconds stand for the plain step's, as the time
# model prices every lever set the same.

# Note [timing a step that does not fit]
# The time model needs a whole step's forward and backward seconds. Where the plain step
# does not fit, it is timed split into micro-batches (the same work, plus what each
# micro-batch repeats, which the step model prices and takes off again:
# See Note [what a micro-batch costs] in memfit/stepmodel/time.py) or, failing that,
# with every block fully checkpointed, whose backward less the blocks' recompute (fitted
# to the heaviest block run alone, see memfit/measuring/prices.py) is the plain
# backward. The prices and the plain step's scales depend on each other, so the fit is
# made twice.


@dataclass(frozen=True)
class TimingLever:
    """A lever whole steps may be timed with where no step without it fits; the planner makes
    it (:mod:`memfit.planning.measure`).
    See Note [timing with a lever]."""

    name: str
    described: str
    """What it does, for the profile's notes ("the loss head in chunks of 262 tokens")."""
    predict: Callable[[Profile], Profile]
    """A profile without the lever -> the step with it."""
    applied: Callable[[], AbstractContextManager[Any]]
    """The lever on the model while a step is timed, taken off after."""
    moved_flops: float = 0.0
    """Backward work it runs in the forward instead."""
