"""What splitting the batch into micro-batches costs, timed on the whole step.

Splitting keeps a step's FLOPs and bytes but runs every op once per micro-batch, on fewer
rows, and each kind of block loses differently: a CNN's early blocks (many pixels, few
channels) barely notice a batch of one image, its late ones (few pixels, many channels)
run several times slower per image. One block timed in micro-batches and carried to the
others missed that by 1.4x on a ResNet-18-style CNN (issue 36), so the step's forward and
backward are timed whole and in a few counts of micro-batches, round by round, the counts
side by side with the whole run of their round: every part of the step is in the ratio.

Trade-off: planning time. A count of k micro-batches is timed on a quarter of the batch's
rows (k / 4 of them, gradients accumulating, as a split step runs them; half or one where
k is not a multiple of 4) and scaled to the whole, so a round costs about two steps, one of
them a timed step the profile needs anyway (See Note [a split round's whole run is a timed step]);
timing stops after ``within`` seconds once :data:`MIN_ROUNDS` rounds ran. The ratio is the step's
as a whole, so a checkpointed block's recompute is priced at the step's ratio, not its own.

Example:
    >>> counts = split_counts(32)
    >>> counts
    [2, 8, 32]
    >>> seconds = {1: 1.0, 2: 1.1, 8: 1.3, 32: 2.0}
    >>> times, why = time_split_steps(lambda k: seconds[k], counts, rounds=3)
    >>> times["none"], times["micro-batches: 32"], why
    ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], '')
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext

from torch import nn

from memfit import progress
from memfit.checkpointing import set_block_modes, uncheckpoint
from memfit.devices import model_device, seconds_of
from memfit.measuring.prices import micro_label
from memfit.measuring.timing_lever import TimingLever
from memfit.precision import Precision
from memfit.step import Batch, LossFn, split_batch, training_step
from memfit.vocab import CheckpointMode

# Note [a split round's whole run is a timed step]
# A profile times a few whole steps (the step's own seconds, the median the time model is
# scaled to) and, separately, the step whole and split round by round. The two were the
# same forward and backward run twice: 2 of the 5 whole runs, about 0.2 s of the 3.1-3.8 s a
# plan of the README's GPT took with both cores busy. So a round's whole run is one of the timed steps
# (its optimizer step included; the split counts weigh against its forward and backward),
# and the first round's is the step that captured the timed block's inputs just before.

#: The most micro-batches a step is timed in (a batch of more rows, in the fewest rows of a
#: micro-batch that keep it at most this many).
MOST_MICRO_BATCHES = 64
#: Rounds the step is timed in at least, however long they take.
MIN_ROUNDS = 3

__all__ = [
    "MIN_ROUNDS",
    "MOST_MICRO_BATCHES",
    "configured",
    "split_counts",
    "split_seconds",
    "time_split_steps",
]


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
) -> tuple[dict[str, list[float]], str]:
    """Seconds of ``timed(k)`` (the step's forward and backward in k micro-batches) per round,
    and ``""``: whole under ``"none"`` and in each of ``counts`` under
    :func:`~memfit.measuring.prices.micro_label`, the i-th entries of one round taken side by
    side; or nothing and why the step could not be split. Stops after the round in which
    ``within`` seconds have passed, once :data:`MIN_ROUNDS` were timed (fewer where ``rounds``
    is less).
    """
    if not counts:
        return {}, ""
    times: dict[str, list[float]] = {"none": [], **{micro_label(k): [] for k in counts}}
    began = time.perf_counter()
    shown = progress.phase(f"timing the step in {', '.join(map(str, counts))} micro-batches", total=rounds)
    try:
        with shown as ph:
            for r in range(rounds):
                times["none"].append(timed(1))
                for k in counts:
                    times[micro_label(k)].append(timed(k))
                ph.advance()
                if r + 1 >= MIN_ROUNDS and time.perf_counter() - began > within:
                    break
    except Exception as exc:  # a batch the model cannot take in parts: splitting priced by its ops
        return {}, f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
    return times, ""


@contextmanager
def configured(
    model: nn.Module, blocks: Sequence[str], mode: CheckpointMode, lever: TimingLever | None
) -> Iterator[None]:
    """Every block of ``blocks`` in ``mode`` and ``lever`` on while the body runs (a timing
    configuration); nothing checkpointed after."""
    uncheckpoint(model)
    if mode != "none":
        set_block_modes(model, dict.fromkeys(blocks, mode))
    try:
        with lever.applied() if lever is not None else nullcontext():
            yield
    finally:
        uncheckpoint(model)


def split_seconds(model: nn.Module, batch: Batch, loss_fn: LossFn, precision: Precision, parts: int) -> float:
    """The forward and backward of ``batch`` in ``parts`` micro-batches, in seconds: all of them
    for one part, else the first quarter of them (a half, or one, where ``parts`` is not a
    multiple of 4), gradients accumulating, scaled to all.

    Example:
        >>> import torch
        >>> model = nn.Linear(4, 1)
        >>> loss = lambda m, b: m(b[0]).pow(2).mean()
        >>> split_seconds(model, (torch.ones(8, 4),), loss, Precision("fp32"), 4) > 0
        True
    """
    share = next(d for d in (4, 2, 1) if parts % d == 0) if parts > 1 else 1
    first = split_batch(batch, share)[0] if share > 1 else batch
    step = functools.partial(training_step, model, first, loss_fn, None, precision, parts // share)
    took = seconds_of(step, model_device(model))
    model.zero_grad(set_to_none=True)
    return took * share
