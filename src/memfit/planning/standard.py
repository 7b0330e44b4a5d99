"""The plans PyTorch users already write, as tilings the step model can price and simulate.

Besides keeping everything (``none``), four configurations are what a PyTorch user
reaches for: ``full`` (every block through ``torch.utils.checkpoint``, HF's
``activation_checkpointing_enable()``), ``every2`` (blocks 0, 2, 4, ...), ``sequential``
(``checkpoint_sequential`` with ``round(sqrt(n))`` segments: all but the last
checkpointed as one) and ``selective`` (every block under PyTorch's selective activation
checkpointing). :func:`standard_solutions` gives those that fit a budget, priced and
simulated exactly like the solver's own plans.

The chooser (:mod:`memfit.planning.choose`) takes a plan of its own making only where the
step model predicts it faster than the fastest standard configuration that fits by
:data:`PREFER_STANDARD`. The time model prices counted work, not kernels; between two
plans that recompute nearly the same work its error (a checkpoint call more or less, a
segment's longer backward) is as large as the difference, and a custom plan that only
ties a standard one is more code paths for no gain.

Example:
    >>> from memfit.records import BlockStats, Profile
    >>> blocks = [BlockStats(f"b{i}", saved_bytes={"none": 100, "full": 10},
    ...           backward_peak_bytes={"none": 50, "full": 150},
    ...           backward_seconds={"none": 1.0, "full": 2.0}) for i in range(4)]
    >>> prof = Profile("fp32", "cpu", 1, blocks, BlockStats("outside"), 0, 0, 0, 0,
    ...                chain_links=[True, True, True])
    >>> [name for name, _ in standard_solutions(prof, 1_000)]
    ['none', 'full', 'every2', 'sequential']
    >>> [name for name, _ in standard_solutions(prof, 400)]
    ['full', 'every2', 'sequential']
    >>> standard_name(prof, ["full", "full", "none", "none"], [(0, 1)])
    'sequential'
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from memfit.planning.solver import Solution
from memfit.records import Profile
from memfit.stepmodel import (
    Option,
    block_options,
    block_seconds,
    option_seconds,
    recompute_scale,
    simulate_options,
    tiling,
)
from memfit.stepmodel.options import Segments

__all__ = [
    "PREFER_STANDARD",
    "STANDARD_NAMES",
    "sqrt_segments",
    "standard_name",
    "standard_solutions",
    "standard_tilings",
]

#: A plan no PyTorch strategy writes must be predicted this fraction of a step faster than the
#: fastest standard configuration that fits; otherwise that standard configuration is the plan.
PREFER_STANDARD = 0.03

#: How each standard configuration is written, for notes and messages.
STANDARD_NAMES = {
    "none": "no checkpointing",
    "full": "torch.utils.checkpoint on every block, as HF's activation_checkpointing_enable() does",
    "every2": "torch.utils.checkpoint on every 2nd block: 0, 2, 4, ...",
    "sequential": "checkpoint_sequential with round(sqrt(n)) segments",
    "selective": "selective activation checkpointing on every block",
}


def sqrt_segments(n_blocks: int) -> int:
    """``round(sqrt(n))`` segments (the memory-optimal split of a uniform chain), at least 2.

    checkpoint_sequential never checkpoints its last segment, so one segment would
    checkpoint nothing; two is the least that saves memory.

    Example:
        >>> [sqrt_segments(n) for n in (2, 4, 6, 12, 48)]
        [2, 2, 2, 3, 7]
    """
    return min(n_blocks, max(2, round(math.sqrt(n_blocks))))


def _sequential(profile: Profile) -> list[Option] | None:
    """checkpoint_sequential's split: ``n // k`` blocks per segment, all but the last checkpointed."""
    n = len(profile.blocks)
    if n < 2:
        return None
    k = sqrt_segments(n)
    size = n // k
    ranges = [(i * size, i * size + size - 1) for i in range(k - 1)]
    covered = {j for a, b in ranges for j in range(a, b + 1)}
    modes = ["full" if j in covered else "none" for j in range(n)]
    if not all(m in block_options(b) for m, b in zip(modes, profile.blocks, strict=True)):
        return None
    if size == 1:  # one-block segments are that block checkpointed
        return tiling(profile, modes)
    links = profile.chain_links
    if not all(j < len(links) and links[j] for a, b in ranges for j in range(a, b)):
        return None  # the blocks are not one chain there: checkpoint_sequential cannot run it
    return tiling(profile, modes, ranges)


def standard_tilings(profile: Profile, segments: bool = True) -> dict[str, list[Option]]:
    """Each standard configuration this profile can express, as options in block order.

    A configuration is left out when a block it checkpoints was not profiled in that mode,
    or (``sequential``) when the blocks are not one chain or ``segments`` is False.
    """
    n = len(profile.blocks)
    if n == 0:
        return {}
    wanted = {
        "none": ["none"] * n,
        "full": ["full"] * n,
        "every2": ["full" if j % 2 == 0 else "none" for j in range(n)],
        "selective": ["selective"] * n,
    }
    out: dict[str, list[Option]] = {}
    for name in ("none", "full", "every2", "sequential", "selective"):
        if name == "sequential":
            seq = _sequential(profile) if segments else None
            if seq is not None:
                out[name] = seq
            continue
        modes = wanted[name]
        if all(m in block_options(b) for m, b in zip(modes, profile.blocks, strict=True)):
            out[name] = tiling(profile, modes)
    # With one or two blocks some configurations coincide; the first name is kept.
    unique: dict[str, list[Option]] = {}
    for name, options in out.items():
        if options not in unique.values():
            unique[name] = options
    return unique


def _solution(
    profile: Profile, options: list[Option], micro_batches: int, times: list[dict[str, float]]
) -> Solution:
    modes = ["full"] * len(profile.blocks)
    for o in options:
        if not o.segment:
            modes[o.first] = o.mode
    return Solution(
        modes=modes,
        peak_bytes=simulate_options(profile, options, micro_batches).peak_bytes,
        block_seconds=sum(option_seconds(profile, o, times) for o in options),
        segments=[(o.first, o.last) for o in options if o.segment],
        options=options,
    )


def standard_solutions(
    profile: Profile, budget_bytes: int, micro_batches: int = 1, *, segments: bool = True
) -> list[tuple[str, Solution]]:
    """The standard configurations whose simulated peak fits ``budget_bytes``, named."""
    found = []
    times = [block_seconds(b, recompute_scale(profile)) for b in profile.blocks]  # once, not per option
    for name, options in standard_tilings(profile, segments).items():
        sol = _solution(profile, options, micro_batches, times)
        if sol.peak_bytes <= budget_bytes:
            found.append((name, sol))
    return found


def standard_name(profile: Profile, modes: Sequence[str], segments: Segments = ()) -> str | None:
    """The standard configuration these per-block modes and segments (names or index ranges) are, or None."""
    chosen = tiling(profile, list(modes), segments)
    return next((name for name, opts in standard_tilings(profile).items() if opts == chosen), None)
