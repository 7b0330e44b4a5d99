"""The time model's fitted prices, from one block run alone in each mode and the step run
whole and split, side by side.

:func:`memfit.measuring.block_timing.time_block_modes` runs the heaviest distinct block's
forward and backward alone, its modes interleaved round by round (none, selective, full).
:func:`fit_prices` turns those times into the prices the step model lacks: what a
recompute costs over the forward (``Speed.recompute_scale``) and what selective
checkpointing's dispatch costs per op (``Speed.selective_op_seconds``).
:func:`memfit.measuring.split_timing.time_split_steps` runs the step's forward and
backward whole and in micro-batches, round by round; :func:`fit_split` turns those into
what splitting the batch costs the step (``Speed.micro_batch_ratios``).

Trade-off: on a loaded machine another process takes a share of every run, more in some
rounds than in others; prices fitted to absolute seconds then swing with the load from one
call to the next (a recompute read 0.25x and 4x of its forward in two runs). So each round
gives ratios (a mode's time over ``none``'s in the same round: the same load), rounds that
disagree with the rest are left out, the median of the rest is moved towards what the
counted work predicts by as much as the rounds spread, and only then is it turned into
seconds, at the scale of the whole timed steps. See Note [prices that hold still].

Example:
    >>> steady([1.0, 1.1, 0.9, 1.05, 9.0])
    [1.0, 1.1, 0.9, 1.05]
    >>> round(spread_of([1.0, 1.1, 0.9, 1.05, 9.0]), 3)  # (1.1 - 0.9) / 2 over the median, 1.025
    0.098
    >>> toward(2.0, 1.0, spread=0.0), toward(2.0, 1.0, spread=10.0) < 1.01
    (2.0, True)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from memfit.records import BlockStats, Profile, Speed
from memfit.stepmodel import fill_times, forward_work, micro_batch_seconds, selective_work, tiling

__all__ = [
    "MICRO",
    "OUTLIER_MADS",
    "RECOMPUTE_WIDTH",
    "TimedSteps",
    "fit_prices",
    "fit_split",
    "fit_time_model",
    "micro_label",
    "round_ratios",
    "spread_of",
    "steady",
    "time_noise",
    "timing_spread",
    "toward",
]

#: How the step's runs in k micro-batches are labelled among its times.
MICRO = "micro-batches: "
#: A round whose ratio is further than this many scaled MADs from the median is left out.
OUTLIER_MADS = 3.0
#: How far (natural log) a recompute's price may stray from the forward's by the prior.
RECOMPUTE_WIDTH = 0.5
#: The least the step in micro-batches is taken to cost over whole (a measured gain below
#: this is a disturbed timing).
LEAST_MICRO_RATIO = 1.0


def micro_label(micro_batches: int) -> str:
    """The label of the step's runs in ``micro_batches`` among its times."""
    return f"{MICRO}{micro_batches}"


# Note [prices that hold still]
# What checkpointing costs is timed on one block alone (micro-batches on the step), and a loaded
# machine moves absolute times by tens of percent between calls (and between rounds). So:
# (1) the prices are fitted to ratios within a round (a mode's time over none's, run
# moments apart under the same load), never to seconds from two moments; (2) a round
# further than OUTLIER_MADS scaled median absolute deviations from the median is a
# disturbed one and left out; (3) what the counted work predicts (a recompute is the same
# forward again) is the prior, and the
# median of the rounds moves it by a weight 1 / (1 + (spread / width)^2) in log space, so
# rounds that tell little move it little; (4) the rounds' spread is reported
# (Speed.spread, in the profile's notes) and widens the band of plans that tie (See Note
# [plans repeat] in memfit/planning/choose.py). Seconds come only at the end, from the
# whole timed steps' scale (forward_scale, backward_scale), which moves every plan alike.


def steady(values: Sequence[float]) -> list[float]:
    """``values`` less those further than :data:`OUTLIER_MADS` scaled MADs from the median
    (all of them where the MAD is 0 or there are fewer than three)."""
    if len(values) < 3:
        return list(values)
    mid = statistics.median(values)
    mad = 1.4826 * statistics.median(abs(v - mid) for v in values)
    if mad <= 0:  # more than half are the median itself: the rest are outliers
        return [v for v in values if v == mid]
    return [v for v in values if abs(v - mid) <= OUTLIER_MADS * mad]


def spread_of(values: Sequence[float]) -> float:
    """Half the range of the :func:`steady` values over their median, at most 1 (1 where the
    median is not above 0: they tell nothing); 0 for fewer than two."""
    kept = steady(values)
    if len(kept) < 2:
        return 0.0
    mid = statistics.median(kept)
    return 1.0 if mid <= 0 else min(1.0, (max(kept) - min(kept)) / (2 * mid))


def moved(values: Sequence[float]) -> float:
    """Half the range of ``values`` over their median, outliers kept, at most 1; 0 for fewer
    than two. A load that moved between them shows as one value apart, which :func:`spread_of`
    would drop (See Note [a load that moves] in memfit/planning/choose.py).

    Example:
        >>> moved([1.0, 2.0, 2.0]), spread_of([1.0, 2.0, 2.0])
        (0.25, 0.0)
    """
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    return 1.0 if mid <= 0 else min(1.0, (max(values) - min(values)) / (2 * mid))


def timing_spread(ratios: Mapping[str, Sequence[float]]) -> float:
    """The largest :func:`spread_of` over the ratios of each mode (See Note [plans repeat]).

    Example:
        >>> round(timing_spread({"full": [1.0, 1.2, 1.1], "selective": [2.0, 2.0]}), 3)
        0.091
    """
    return max((spread_of(ts) for ts in ratios.values()), default=0.0)


def time_noise(times: Mapping[str, Sequence[float]]) -> float:
    """How far rounds timed side by side moved a time, as a share of it: each label's seconds
    over ``none``'s in the same round (:func:`spread_of`), and ``none``'s own seconds across
    the rounds, outliers kept (:func:`moved`: a load that moved between rounds); the largest.
    See Note [a load that moves] in memfit/planning/choose.py.

    Example:
        >>> time_noise({"none": [1.0, 1.0, 1.0], "full": [1.2, 1.3, 1.25]})  # the extras spread 0.2
        0.04
        >>> time_noise({"none": [1.0, 2.0, 1.0], "full": [1.2, 2.4, 1.2]})  # the load moved
        0.5
    """
    shares = [spread_of(rs) for rs in _over_none(times).values()]
    return round(max([moved(times["none"]), *shares]), 12)


def toward(measured: float, prior: float, spread: float, width: float = RECOMPUTE_WIDTH) -> float:
    """``measured`` moved towards ``prior`` in log space by as much as ``spread`` says it is
    unsure: weight ``1 / (1 + (spread / width)^2)`` on the measurement
    (See Note [prices that hold still]). Both must be above 0."""
    weight = 1.0 / (1.0 + (spread / width) ** 2)
    return math.exp(weight * math.log(measured) + (1 - weight) * math.log(prior))


def _over_none(times: Mapping[str, Sequence[float]]) -> dict[str, list[float]]:
    """Per round, each label's seconds over ``none``'s in the same round (``times`` has
    ``"none"``)."""
    none = times["none"]
    return {
        m: [t / n for t, n in zip(ts, none, strict=False) if n > 0] for m, ts in times.items() if m != "none"
    }


def round_ratios(times: Mapping[str, Sequence[float]]) -> dict[str, list[float]]:
    """Per round, each mode's seconds over ``none``'s less 1 (its extra), and the runs in
    micro-batches over ``none``'s (:func:`micro_label`)."""
    return {m: [r - (0.0 if m.startswith(MICRO) else 1.0) for r in rs] for m, rs in _over_none(times).items()}


def _whole(prof: Profile, block: BlockStats) -> float:
    """The block's forward and backward without checkpointing, at the timed steps' scale."""
    sp = prof.speed
    assert sp is not None
    return (sp.forward_scale + sp.backward_scale) * forward_work(prof, block)


def _fit_recompute(prof: Profile, block: BlockStats, extras: Sequence[float]) -> float:
    """Fit ``recompute_scale``; returns the spread it was fitted with (1: clamped, unknown)."""
    sp = prof.speed
    assert sp is not None
    modelled = sp.forward_scale * forward_work(prof, block)
    extra = statistics.median(steady(extras)) * _whole(prof, block) - sp.checkpoint_seconds
    spread = spread_of(extras)
    sp.full_steps = len(extras)
    if modelled <= 0 or extra <= 0:
        return 1.0
    fitted = toward(extra / modelled, 1.0, spread)
    # A recompute is the same forward again: a fit outside a quarter to four times it is a
    # disturbed timing, not the model, so it is clamped there (and the timings, telling
    # nothing, spread 1).
    sp.recompute_scale = min(4.0, max(0.25, fitted))
    return spread if sp.recompute_scale == fitted else 1.0


def _fit_selective(prof: Profile, block: BlockStats, extras: Sequence[float]) -> float:
    """Fit ``selective_op_seconds`` (never below the micro-benchmark's); returns the spread."""
    sp = prof.speed
    assert sp is not None
    extra = statistics.median(steady(extras)) * _whole(prof, block)
    counted = sp.forward_scale * sp.recompute_scale * selective_work(prof, block) + sp.checkpoint_seconds
    sp.selective_op_seconds = max(sp.selective_op_seconds, (extra - counted) / (2 * block.forward_ops))
    sp.selective_steps = len(extras)
    return spread_of(extras)


def _monotone(ratios: list[float]) -> list[float]:
    """``ratios`` made non-decreasing (pooled where a later one is lower): more micro-batches
    never cost less, however the rounds fell.

    Example:
        >>> _monotone([2.4, 2.2, 1.7, 3.0])
        [2.1, 2.1, 2.1, 3.0]
    """
    blocks: list[list[float]] = []
    for r in ratios:
        blocks.append([r])
        while len(blocks) > 1 and statistics.mean(blocks[-2]) > statistics.mean(blocks[-1]):
            blocks[-2:] = [blocks[-2] + blocks[-1]]
    return [round(statistics.mean(b), 12) for b in blocks for _ in b]


def _fit_micro_batches(prof: Profile, ratios: Mapping[str, Sequence[float]], split: int = 1) -> None:
    """Record the step's seconds in each count of micro-batches over whole: the median of the
    steady rounds, at least :data:`LEAST_MICRO_RATIO`, made non-decreasing in the count; and
    how far each count's rounds spread (``Speed.micro_spreads``). Where the step timed was one of
    ``split`` micro-batches, its counts are of those (:func:`_from_split`).

    No prior pulls these: what splitting costs a model's kernels (a convolution on one image
    runs several times slower per image) is not in its counted ops.
    See Note [what a micro-batch costs] in memfit/stepmodel/time.py.
    """
    sp = prof.speed
    assert sp is not None
    found = sorted((int(label[len(MICRO) :]), rs) for label, rs in ratios.items() if label.startswith(MICRO))
    medians = _monotone([max(LEAST_MICRO_RATIO, statistics.median(steady(rs))) for _, rs in found])
    counts = [k for k, _ in found]
    sp.micro_batches, sp.micro_batch_ratios = _from_split(counts, medians, split) if counts else ([], [])
    spreads = [spread_of(rs) for _, rs in found]
    # the count the step was timed in (first, where split) is not a ratio timed: the largest
    sp.micro_spreads = [max(spreads, default=0.0)] * (len(sp.micro_batches) - len(spreads)) + spreads


def _from_split(counts: list[int], ratios: list[float], split: int) -> tuple[list[int], list[float]]:
    """Counts and ratios of the whole batch, from those of one of ``split`` micro-batches.

    The block whole was itself one of ``split``: in ``m`` more it ran in ``split * m`` of the
    batch. What ``split`` costs over the batch whole is not timed; it is taken linear in the
    count, ``1 + (k - 1) * phi``, with ``phi`` (the median) making each measured ratio
    ``(1 + (split * m - 1) * phi) / (1 + (split - 1) * phi)``.

    Example:
        >>> _from_split([2, 4], [1.5, 2.5], 1)
        ([2, 4], [1.5, 2.5])
        >>> _from_split([2], [1.5], 2)  # phi = 0.5 / (4 - 1 - 1.5): 1/3
        ([2, 4], [1.333333, 2.0])
    """
    if split <= 1:
        return counts, ratios
    below = [(r - 1, split * m - 1 - r * (split - 1)) for m, r in zip(counts, ratios, strict=True)]
    phi = statistics.median([a / b for a, b in below if a >= 0 and b > 0] or [1.0])  # b <= 0: phi unbounded
    base = 1 + (split - 1) * phi
    return [split, *(split * m for m in counts)], [round(base, 6), *(round(r * base, 6) for r in ratios)]


def fit_prices(prof: Profile, name: str, times: Mapping[str, Sequence[float]], split: int = 1) -> None:
    """Fit ``prof.speed``'s prices to block ``name``'s times alone, one list per mode with
    the i-th entries taken side by side (See Note [prices that hold still]); the block ran on
    the inputs of one of ``split`` micro-batches (the whole steps were timed so).

    ``recompute_scale``: the full extra, less one checkpoint call, over the block's scaled
    forward. ``selective_op_seconds``: what the selective extra leaves after its counted
    recompute and call, per op dispatched (forward and recompute), never below the
    micro-benchmark's. ``spreads``: the spread of the rounds each price was fitted to (of its
    extras), ``spread`` the largest; ``noise``: how far the rounds moved a time
    (:func:`time_noise`).
    """
    sp: Speed | None = prof.speed
    block = next((b for b in prof.blocks if b.name == name), None)
    if sp is None or block is None or not times.get("none"):
        return
    sp.timed_block = name
    ratios = round_ratios(times)
    spreads: dict[str, float] = {}
    if ratios.get("full"):
        spreads["full"] = _fit_recompute(prof, block, ratios["full"])
    if ratios.get("selective") and block.forward_ops:
        spreads["selective"] = _fit_selective(prof, block, ratios["selective"])
    sp.spreads, sp.spread = spreads, max(spreads.values(), default=0.0)
    sp.noise = max(sp.noise, time_noise(times))


def fit_split(prof: Profile, times: Mapping[str, Sequence[float]], split: int = 1) -> None:
    """Fit ``prof.speed``'s ``micro_batches`` and ``micro_batch_ratios`` (their spreads in
    ``micro_spreads``; how far the step whole moved across the rounds in ``noise``) to the
    step's forward and backward timed whole (``"none"``) and in
    micro-batches (:func:`micro_label`), the i-th entries side by side
    (:func:`~memfit.measuring.split_timing.time_split_steps`); the step timed was one of
    ``split`` micro-batches (:func:`_from_split`). Nothing timed: the lists stay empty."""
    if prof.speed is not None:
        _fit_micro_batches(prof, round_ratios(times) if times.get("none") else {}, split)
        # each count's own rounds are its plans' spread; the step whole's are the machine's
        prof.speed.noise = max(prof.speed.noise, moved(times.get("none") or []))


class TimedSteps(NamedTuple):
    """Whole steps timed: (forward, backward, whole) seconds each, in ``mode`` and
    ``micro_batches`` (the plain step where it fits), described for the profile's notes."""

    times: Sequence[tuple[float, float, float]]
    mode: str
    micro_batches: int
    described: str
    moved_flops: float = 0.0
    """Backward work the lever they were timed with ran in the forward, moved back before the
    fit (See Note [timing with a lever] in memfit/measuring/timing_lever.py)."""


def _moved_back(prof: Profile, steps: TimedSteps, fwd: float, bwd: float) -> tuple[float, float]:
    """``fwd`` and ``bwd`` with the seconds of ``steps.moved_flops`` moved back from the forward
    to the backward (a share of the forward by counted work)."""
    if steps.moved_flops <= 0:
        return fwd, bwd
    counted = sum(p.forward_flops for p in [*prof.blocks, prof.outside])
    moved = fwd * steps.moved_flops / (counted + steps.moved_flops)
    return fwd - moved, bwd + moved


def _as_plain(
    prof: Profile, steps: TimedSteps, fwd: float, bwd: float, step: float
) -> tuple[float, float, float]:
    """The whole batch's forward, backward and step seconds without checkpointing, from those
    timed: less every block's recompute where fully checkpointed, less what the micro-batches
    add (See Note [what a micro-batch costs] in memfit/stepmodel/time.py)."""
    sp = prof.speed
    assert sp is not None
    if steps.mode == "full":
        recompute = sum(
            sp.forward_scale * sp.recompute_scale * forward_work(prof, b) + sp.checkpoint_seconds
            for b in prof.blocks
        )
        bwd, step = max(0.0, bwd - recompute), max(0.0, step - recompute)
    extra = micro_batch_seconds(prof, tiling(prof, steps.mode), steps.micro_batches)
    keep = max(0.0, 1 - extra / (fwd + bwd)) if fwd + bwd > 0 else 1.0
    return fwd * keep, bwd * keep, max(0.0, step - extra)


def fit_time_model(
    prof: Profile,
    speed: Speed,
    steps: TimedSteps,
    timed_block: str,
    times: Mapping[str, Sequence[float]],
    split_times: Mapping[str, Sequence[float]] | None = None,
) -> None:
    """Set ``prof.speed`` from the micro-benchmarks' ``speed``, scaled so the counted work takes
    the timed steps' seconds, with the prices fitted to ``timed_block``'s ``times`` alone
    (:func:`fit_prices`) and micro-batches' to the step timed split, ``split_times``
    (:func:`fit_split`), and fill every block's times. The prices and the plain step's scales
    depend on each other (a step timed in micro-batches or checkpointed is turned into the
    plain one by them), so the fit is made twice.
    """
    fwd, bwd = _moved_back(prof, steps, *(statistics.median(t[k] for t in steps.times) for k in range(2)))
    step = plain = (fwd, bwd, prof.step_seconds)
    prof.speed = speed  # the raw prices: what the counted work is worth before scaling
    work = sum(forward_work(prof, b) for b in [*prof.blocks, prof.outside]) or 1.0
    for _ in range(2):
        sp = Speed(**{**speed.to_dict(), "timed_steps": len(steps.times)})
        sp.forward_scale, sp.backward_scale = plain[0] / work, plain[1] / work
        prof.speed = sp
        if times:
            fit_prices(prof, timed_block, times, steps.micro_batches)
        fit_split(prof, split_times or {}, steps.micro_batches)
        plain = _as_plain(prof, steps, *step)
    whole = moved([t[2] for t in steps.times])  # See Note [a load that moves]
    sp.spread, sp.noise = max(sp.spread, whole), max(sp.noise, whole)
    sp.forward_scale, sp.backward_scale = plain[0] / work, plain[1] / work
    prof.step_seconds, sp.timed_as = plain[2], steps.described
    fill_times(prof)
