"""What splitting the batch into micro-batches costs, timed on the whole step.

Splitting keeps a step's FLOPs and bytes but runs every op once per micro-batch, on fewer
rows, and each kind of block loses differently: a CNN's early blocks (many pixels, few
channels) barely notice a batch of one image, its late ones (few pixels, many channels)
run several times slower per image. One block timed in micro-batches and carried to the
others missed that by 1.4x on a ResNet-18-style CNN (issue 36), so the step's forward and
backward are timed whole and in a few counts of micro-batches, round by round, the counts
side by side with the whole run of their round: every part of the step is in the ratio.

Trade-off: a whole step per count and round costs planning time (bounded by ``within``
seconds after :data:`MIN_ROUNDS` rounds); the ratio is the step's as a whole, so a
checkpointed block's recompute is priced at the step's ratio, not its own.

Example:
    >>> counts = split_counts(32)
    >>> counts
    [2, 8, 32]
    >>> seconds = {1: 1.0, 2: 1.1, 8: 1.3, 32: 2.0}
    >>> times = time_split_steps(lambda k: seconds[k], counts, rounds=3)
    >>> times["none"], times["micro-batches: 32"]
    ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from memfit import progress
from memfit.measuring.prices import micro_label

#: The most micro-batches a step is timed in (a batch of more rows, in the fewest rows of a
#: micro-batch that keep it at most this many).
MOST_MICRO_BATCHES = 64
#: Rounds the step is timed in at least, however long they take.
MIN_ROUNDS = 3

__all__ = ["MIN_ROUNDS", "MOST_MICRO_BATCHES", "split_counts", "time_split_steps"]


def split_counts(rows: int) -> list[int]:
    """Counts of micro-batches a batch of ``rows`` is timed in: 2, as many as it has rows (at
    most :data:`MOST_MICRO_BATCHES`) and one between them in log k (the curve bends); only
    counts that split the rows evenly (none for a batch of one).

    Example:
        >>> split_counts(16), split_counts(12), split_counts(2), split_counts(1)
        ([2, 4, 16], [2, 6, 12], [2], [])
    """
    counts = [k for k in range(2, min(rows, MOST_MICRO_BATCHES) + 1) if rows % k == 0]
    if not counts:
        return []
    most = counts[-1]
    middle = min(counts[1:-1], key=lambda k: abs(math.log(k * k / (2 * most))), default=2)
    return sorted({2, middle, most})


def time_split_steps(
    timed: Callable[[int], float], counts: Sequence[int], rounds: int, within: float = math.inf
) -> dict[str, list[float]]:
    """Seconds of ``timed(k)`` (the step's forward and backward in k micro-batches) per round:
    whole under ``"none"`` and in each of ``counts`` under
    :func:`~memfit.measuring.prices.micro_label`, the i-th entries of one round, taken side
    by side. Stops after the round in which ``within`` seconds have passed, once
    :data:`MIN_ROUNDS` were timed (fewer where ``rounds`` is less).
    """
    times: dict[str, list[float]] = {"none": [], **{micro_label(k): [] for k in counts}}
    if not counts:
        return {}
    began = time.perf_counter()
    shown = progress.phase(f"timing the step in {', '.join(map(str, counts))} micro-batches", total=rounds)
    with shown as ph:
        for r in range(rounds):
            times["none"].append(timed(1))
            for k in counts:
                times[micro_label(k)].append(timed(k))
            ph.advance()
            if r + 1 >= MIN_ROUNDS and time.perf_counter() - began > within:
                break
    return times
