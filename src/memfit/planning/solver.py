"""The exact solver: the fastest options (per-block modes, segments) that keep every event under budget.

Each block is covered by one option: its own mode (none / selective / full) or a segment
of consecutive blocks checkpointed as one (:mod:`memfit.stepmodel.options`). The objective
is the predicted step time; each memory event of the step model is one linear
constraint, so the integer program below is the planning problem itself, not an
approximation of it. HiGHS solves it through ``scipy.optimize.milp`` with a zero
optimality gap, and the answer is checked again in exact integer bytes by the simulator.

Ties: the time model resolves differences of a few percent at best, so plans whose
predicted time is within ``tie_seconds`` of the fastest, or within the measured ``noise``
of their checkpointing extras (:func:`as_fast`), count as equally fast; among them the
solver takes the least counted work (:func:`counted_work`: the ops selective
checkpointing dispatches, then the FLOPs recomputed), then the lowest peak, then a fixed
order of options (more programs). The answer then depends on exact numbers (ops, FLOPs,
bytes, block order), not on the noise in the time model's last digits: the same model gets the same
plan (See Note [plans repeat]).

Trade-off: an integer program proves optimality (a greedy rule does not) at the cost of
up to three solver calls per (precision, micro-batch count); with a few hundred binaries
that is milliseconds.

Example:
    >>> from memfit.records import BlockStats, Profile
    >>> blocks = [BlockStats(f"b{i}", saved_bytes={"none": 100, "full": 10},
    ...           backward_peak_bytes={"none": 50, "full": 150},
    ...           backward_seconds={"none": 1.0, "full": 2.0}) for i in range(3)]
    >>> prof = Profile(precision="fp32", device="cpu", batch_size=1, blocks=blocks,
    ...                outside=BlockStats("outside"), param_bytes=0, grad_bytes=0,
    ...                optimizer_bytes=0, optimizer_temp_bytes=0)
    >>> solve(prof, budget_bytes=300).modes  # one block recomputes: the first (the lowest peak)
    ['full', 'none', 'none']
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from memfit.records import BlockStats, Profile
from memfit.stepmodel import (
    Event,
    Option,
    all_options,
    block_options,
    block_seconds,
    events,
    option_seconds,
    recompute_scale,
    simulate_options,
)

__all__ = ["Solution", "as_fast", "counted_work", "minimum_peak", "solve", "useful_modes"]


@dataclass
class Solution:
    """The solver's answer for one profile and micro-batch count."""

    modes: list[str]
    """Mode per block, in profile order (``none`` / ``selective`` / ``full``; ``full`` in a segment)."""
    peak_bytes: int
    """The simulator's peak for this plan (exact integer bytes)."""
    block_seconds: float
    """Sum of the chosen options' times: the objective."""
    segments: list[tuple[int, int]] = field(default_factory=list)
    """Segments as ``(first, last)`` block indices."""
    options: list[Option] = field(default_factory=list)
    """The chosen options in block order."""


def _costs(block: BlockStats, mode: str) -> tuple[int, ...]:
    """What a block adds to each kind of event in ``mode``: held, forward, saved, own backward."""
    saved = block.saved_bytes[mode]
    held = block.held_bytes.get(mode, saved)
    return held, block.forward_peak_bytes.get(mode, saved), saved, saved + block.backward_peak_bytes[mode]


def useful_modes(block: BlockStats) -> list[str]:
    """The block's modes less those that hold at least as much as keeping it at every moment."""
    # Such a mode is slower than keeping the block and lowers no event of the step, so no
    # plan should choose it (a block whose input is not otherwise kept, or whose recompute
    # peaks high, can have one).
    options = block_options(block)
    if "none" not in options:
        return options
    keep = _costs(block, "none")
    return [
        m for m in options if m == "none" or any(c < k for c, k in zip(_costs(block, m), keep, strict=True))
    ]


class _Program:
    """The options, their seconds, the one-option-per-block rows and the event rows."""

    def __init__(self, profile: Profile, micro_batches: int, use_segments: bool) -> None:
        self.profile = profile
        opts = all_options(profile)
        useful = [useful_modes(b) for b in profile.blocks]
        self.options = [
            o for o in opts if (use_segments or not o.segment) and (o.segment or o.mode in useful[o.first])
        ]
        per = [block_seconds(b, recompute_scale(profile)) for b in profile.blocks]
        self.seconds = np.array([option_seconds(profile, o, per) for o in self.options], dtype=float)
        n, v = len(profile.blocks), len(self.options)
        self.cover = np.zeros((n, v))
        for k, o in enumerate(self.options):
            self.cover[o.first : o.last + 1, k] = 1.0
        self.events: list[Event] = events(profile, micro_batches, self.options)
        self.rows = np.zeros((len(self.events), v))
        index = {o: k for k, o in enumerate(self.options)}
        for r, ev in enumerate(self.events):
            for o, b in ev.coef.items():
                self.rows[r, index[o]] = b
        self.const = np.array([ev.const for ev in self.events], dtype=float)
        counted = [counted_work(profile, o) for o in self.options]
        self.work = [np.array([c[k] for c in counted], dtype=float) for k in range(2)]

    def run(
        self, cost: np.ndarray, extra: list[LinearConstraint], peak_var: bool, budget: float
    ) -> np.ndarray | None:
        """Solve with the event rows (<= budget, or <= z when ``peak_var``), return x or None."""
        v = len(self.options)
        scale = max(1.0, budget if not peak_var else float(self.const.max(initial=1.0)))
        width = v + (1 if peak_var else 0)
        cover = np.zeros((self.cover.shape[0], width))
        cover[:, :v] = self.cover
        rows = np.zeros((self.rows.shape[0], width))
        rows[:, :v] = self.rows / scale
        if peak_var:
            rows[:, -1] = -1.0
            rhs = -self.const / scale
        else:
            rhs = (budget - self.const) / scale
        cons = [LinearConstraint(cover, 1.0, 1.0), LinearConstraint(rows, -np.inf, rhs)]
        cons += [
            LinearConstraint(np.pad(c.A, ((0, 0), (0, width - c.A.shape[1]))), c.lb, c.ub) for c in extra
        ]
        integrality = np.ones(width)
        lo, hi = np.zeros(width), np.ones(width)
        if peak_var:
            integrality[-1], lo[-1], hi[-1] = 0, -np.inf, np.inf
        res = milp(
            np.pad(cost, (0, width - len(cost))),
            constraints=cons,
            integrality=integrality,
            bounds=Bounds(lo, hi),
            options={"mip_rel_gap": 0.0, "presolve": True},
        )
        if res.x is None or res.status != 0:
            return None
        return np.asarray(res.x[:v])

    def picked(self, x: np.ndarray) -> list[Option]:
        return sorted(o for o, val in zip(self.options, x, strict=True) if val > 0.5)


def counted_work(profile: Profile, option: Option) -> tuple[int, int]:
    """What ``option`` adds to the step, counted, not timed: the aten ops selective
    checkpointing dispatches in its mode (forward and recompute), and the FLOPs it
    recomputes in the backward (FlopCounterMode's counts). See Note [plans repeat].

    Example:
        >>> from memfit.records import BlockStats, Profile
        >>> b = BlockStats("b0", saved_bytes={"none": 8, "full": 1},
        ...                backward_peak_bytes={"none": 1, "full": 2}, forward_ops=7,
        ...                forward_flops=10, backward_flops={"none": 20, "full": 30})
        >>> prof = Profile("fp32", "cpu", 1, [b], BlockStats("outside"), 0, 0, 0, 0)
        >>> counted_work(prof, Option(0, 0, "full")), counted_work(prof, Option(0, 0, "none"))
        ((0, 10), (0, 0))
    """
    ops = flops = 0
    mode = "full" if option.segment else option.mode
    for block in profile.blocks[option.first : option.last + 1]:
        first = block_options(block)[:1] or [mode]
        flops += max(0, block.backward_flops.get(mode, 0) - block.backward_flops.get(first[0], 0))
        ops += 2 * block.forward_ops if mode == "selective" else 0
    return ops, flops


def as_fast(fastest: tuple[float, float], other: tuple[float, float], tie: float, noise: float) -> bool:
    """Whether ``other`` (seconds, of which checkpointing's extra) ties ``fastest``: it is at most
    ``tie`` slower, plus ``noise`` of both extras. See Note [plans repeat].

    Example:
        >>> as_fast((1.0, 0.1), (1.05, 0.15), tie=0.02, noise=0.0)
        False
        >>> as_fast((1.0, 0.1), (1.05, 0.15), tie=0.02, noise=0.2)
        True
    """
    return other[0] - fastest[0] <= tie + noise * (fastest[1] + other[1])


def _band(best: float, floor: float, tie: float, noise: float) -> float:
    """The highest cost that ties ``best`` by :func:`as_fast` where both extras are over ``floor``:
    ``c - best <= tie + noise * (c - floor + best - floor)``, solved for ``c``."""
    if noise >= 1.0:
        return np.inf
    return (best * (1 + noise) + tie - 2 * noise * floor) / (1 - noise)


def _floor(prog: _Program, cost: np.ndarray) -> float:
    """The least cost any plan could have: each block at its cheapest mode, budget aside."""
    least: dict[int, float] = {}
    for k, o in enumerate(prog.options):
        if not o.segment:
            least[o.first] = min(least.get(o.first, np.inf), float(cost[k]))
    return sum(least.values())


def _solution(prog: _Program, chosen: list[Option], micro_batches: int) -> Solution:
    modes = ["full"] * len(prog.profile.blocks)
    for o in chosen:
        if not o.segment:
            modes[o.first] = o.mode
    peak = simulate_options(prog.profile, chosen, micro_batches, prog.events).peak_bytes
    seconds = float(sum(prog.seconds[prog.options.index(o)] for o in chosen))
    segs = [(o.first, o.last) for o in chosen if o.segment]
    return Solution(modes=modes, peak_bytes=peak, block_seconds=seconds, segments=segs, options=chosen)


def _order(prog: _Program) -> np.ndarray:
    """A fixed preference among equal plans: per block none, selective, full, then segments,
    later blocks' choices weighing more, so the earlier blocks recompute (exact, so the same
    model gets the same plan)."""
    # Each option's rank is weighed by its first block's place (1 for the first block, up
    # towards 2 for the last). A weight the same for every place would make the plans that
    # place the same modes on identical blocks in another order cost the same, and HiGHS
    # would return whichever it met first; with weights rising strictly, the cheapest of
    # those is unique (the heavier ranks on the earlier blocks).
    rank = {"none": 0, "selective": 1, "full": 2}
    n = max(1, len(prog.profile.blocks))
    return np.array(
        [
            (3 if o.segment else rank[o.mode]) * (1 + o.first / n) + (o.last - o.first) / (n * n)
            for o in prog.options
        ]
    )


def solve(
    profile: Profile,
    budget_bytes: int,
    micro_batches: int = 1,
    *,
    tie_seconds: float = 0.0,
    segments: bool = True,
    noise: float = 0.0,
) -> Solution | None:
    """The least-time plan whose simulated peak is at or under ``budget_bytes``.

    Args:
        profile: measured per-block costs at one precision.
        budget_bytes: the limit every event of the step must respect.
        micro_batches: gradient-accumulation micro-batches (activations scale down).
        tie_seconds: plans within this many seconds of the fastest are equally fast; the
            fewest recomputed FLOPs among them win, then the lowest peak (0: the fastest
            only, ties broken the same way).
        segments: also consider segments (where the profile's chain links allow them).
        noise: the time model's relative uncertainty (``Speed.spread``): plans also tie where
            they differ by less than this much of their checkpointing extras, and among
            ties the least counted work wins first (See Note [plans repeat]).

    Returns:
        The :class:`Solution`, or None when no plan fits.
    """
    prog = _Program(profile, micro_batches, segments)
    if not prog.options:
        chosen: list[Option] = []
        sol = _solution(prog, chosen, micro_batches)
        return sol if sol.peak_bytes <= budget_bytes else None
    top = float(prog.seconds.max()) or 1.0
    cost = prog.seconds / top
    floor = _floor(prog, cost)
    tighten = 0.0
    for _ in range(4):
        budget = budget_bytes - tighten
        if np.any((prog.const > budget) & ~prog.rows.any(axis=1)):
            return None
        x = prog.run(cost, [], False, budget)
        if x is None:
            return None
        best = float(cost @ x)
        # HiGHS proves optimality to ~1e-7 of the normalised objective; the band below takes
        # at least that, so plans the solver cannot tell apart are ties too.
        tie = max(tie_seconds / top, 1e-6 * max(1.0, best))
        limits = [(cost, max(best + tie, _band(best, floor, tie, noise)))]
        keep = [LinearConstraint(cost.reshape(1, -1), -np.inf, limits[0][1])]
        for counts in prog.work:
            x = _least(prog, counts, x, keep, limits, budget)
        chosen = _lowest_peak(prog, x, keep, limits, budget, micro_batches)
        sol = _solution(prog, chosen, micro_batches)
        if sol.peak_bytes <= budget_bytes:
            return sol
        # HiGHS accepts rows violated by up to its feasibility tolerance (~1e-7 of the budget);
        # the exact check caught one, so the rows are tightened by the excess.
        tighten += sol.peak_bytes - budget_bytes
    return None


#: Upper bounds a plan ``x`` must meet exactly: ``vector @ x <= bound``.
_Limits = list[tuple[np.ndarray, float]]


def _least(
    prog: _Program,
    counts: np.ndarray,
    x: np.ndarray,
    keep: list[LinearConstraint],
    limits: _Limits,
    budget: float,
) -> np.ndarray:
    """Among plans meeting ``keep`` (``x`` one of them), those with the least ``counts`` (a
    :func:`counted_work` column): their bound is added to ``keep`` and ``limits``; returns
    one of them (``x`` where nothing is counted)."""
    # See Note [plans repeat]
    top = float(counts.max(initial=0.0))
    if top <= 0:
        return x
    fewest = _within(prog.run(counts / top, keep, False, budget), limits)
    if fewest is None:
        fewest = x
    bound = float(counts @ fewest) + 0.5  # counts are integers: "at most r + 0.5" is "at most r"
    keep.append(LinearConstraint((counts / top).reshape(1, -1), -np.inf, bound / top))
    limits.append((counts, bound))
    return fewest


def _lowest_peak(
    prog: _Program,
    x: np.ndarray,
    keep: list[LinearConstraint],
    limits: _Limits,
    budget: float,
    micro_batches: int,
) -> list[Option]:
    """Among plans meeting ``keep`` (``x`` one of them), the lowest peak, then :func:`_order`'s."""
    cost = prog.seconds / (float(prog.seconds.max()) or 1.0)
    peak_cost = np.zeros(len(prog.options) + 1)
    peak_cost[-1] = 1.0
    # HiGHS lets a row be violated by its feasibility tolerance (1e-6 of the row): every
    # answer asked for "within the band" is checked against the band exactly.
    lowest = _within(prog.run(peak_cost, keep, True, budget), limits)
    chosen = prog.picked(x if lowest is None else lowest)
    peak = float(simulate_options(prog.profile, chosen, micro_batches, prog.events).peak_bytes)
    # HiGHS stops within an absolute gap of 1e-6 of the normalised peak, a byte at a
    # megabyte scale; asking in exact bytes for one byte less settles the lowest peak.
    for _ in range(3):
        lower = _within(prog.run(cost, keep, False, peak - 1), limits)
        if lower is None:
            break
        found = prog.picked(lower)
        found_peak = simulate_options(prog.profile, found, micro_batches, prog.events).peak_bytes
        if found_peak >= peak:
            break
        chosen, peak = found, float(found_peak)
    # Bytes are integers, so "at most peak + 0.5" is "at most peak" (every plan at the lowest
    # peak, the one found among them); HiGHS's MIP feasibility tolerance (1e-6 of the scaled
    # row) may let in a plan a byte over, and the exact check below keeps it out.
    scale = max(1.0, peak)
    at_peak = LinearConstraint(prog.rows / scale, -np.inf, (peak + 0.5 - prog.const) / scale)
    ordered = _within(prog.run(_order(prog), [*keep, at_peak], False, budget), limits)
    if ordered is not None:
        preferred = prog.picked(ordered)
        if simulate_options(prog.profile, preferred, micro_batches, prog.events).peak_bytes <= peak:
            chosen = preferred
    return chosen


def _within(x: np.ndarray | None, limits: _Limits) -> np.ndarray | None:
    """``x`` where it meets every limit exactly (on its first ``len(vector)`` entries), else None."""
    if x is None or any(float(v @ x[: len(v)]) > bound for v, bound in limits):
        return None
    return x


def minimum_peak(profile: Profile, micro_batches: int = 1, *, segments: bool = True) -> Solution:
    """The plan with the smallest simulated peak (ties: least time), for error messages.

    Minimises ``z`` subject to every event <= ``z``, then re-solves for time at that peak.
    """
    prog = _Program(profile, micro_batches, segments)
    if not prog.options:
        return _solution(prog, [], micro_batches)
    peak_cost = np.zeros(len(prog.options) + 1)
    peak_cost[-1] = 1.0
    x = prog.run(peak_cost, [], True, 0.0)
    if x is None:  # pragma: no cover - the program always has a solution
        raise RuntimeError("HiGHS found no minimum-peak plan")
    chosen = prog.picked(x)
    peak = simulate_options(profile, chosen, micro_batches, prog.events).peak_bytes
    best = solve(profile, peak, micro_batches, segments=segments)
    return best if best is not None else _solution(prog, chosen, micro_batches)
