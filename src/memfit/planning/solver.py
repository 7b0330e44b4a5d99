"""The exact solver: the fastest per-block checkpointing that keeps every event under budget.

Each block picks one mode (keep / selective / full). The objective is the predicted step
time (sum of the chosen modes' measured times); each memory event of the simulator is one
linear constraint, so the integer program below is the planning problem itself, not an
approximation of it. It is solved by HiGHS through ``scipy.optimize.milp`` with a zero
optimality gap, and the answer is checked again in exact integer bytes by the simulator.

Trade-off: an integer program proves optimality (a greedy rule does not) at the cost of a
solver call per (precision, micro-batch count); with a few hundred binaries that is
milliseconds.

Example:
    >>> from memfit.records import BlockStats, Profile
    >>> blocks = [BlockStats(f"b{i}", saved_bytes={"none": 100, "full": 10},
    ...           backward_peak_bytes={"none": 50, "full": 150},
    ...           backward_seconds={"none": 1.0, "full": 2.0}) for i in range(3)]
    >>> prof = Profile(precision="fp32", device="cpu", batch_size=1, blocks=blocks,
    ...                outside=BlockStats("outside"), param_bytes=0, grad_bytes=0,
    ...                optimizer_bytes=0, optimizer_temp_bytes=0)
    >>> sorted(solve(prof, budget_bytes=300).modes)  # one block recomputes, two keep
    ['full', 'none', 'none']
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from memfit.records import BlockStats, Profile
from memfit.stepmodel import block_options, block_seconds, events, simulate

__all__ = ["Solution", "minimum_peak", "solve", "useful_modes"]


@dataclass
class Solution:
    """The solver's answer for one profile and micro-batch count."""

    modes: list[str]
    """Mode per block, in profile order (``none`` / ``selective`` / ``full``)."""
    peak_bytes: int
    """The simulator's peak for these modes (exact integer bytes)."""
    block_seconds: float
    """Sum of the chosen modes' block times: the objective."""


def _costs(block: BlockStats, mode: str) -> tuple[int, ...]:
    """What a block adds to each kind of event in ``mode``: held, forward, saved, own backward."""
    saved = block.saved_bytes[mode]
    held = block.held_bytes.get(mode, saved)
    return held, block.forward_peak_bytes.get(mode, saved), saved, saved + block.backward_peak_bytes[mode]


def useful_modes(block: BlockStats) -> list[str]:
    """The block's modes less those that hold at least as much as keeping it at every moment.

    # NOTE: such a mode is slower than keeping the block and never lowers any event of the
    # step, so no plan should choose it (a block whose input is not otherwise kept, or whose
    # recompute peak is high, can be one).
    """
    options = block_options(block)
    if "none" not in options:
        return options
    keep = _costs(block, "none")
    return [
        m for m in options if m == "none" or any(c < k for c, k in zip(_costs(block, m), keep, strict=True))
    ]


def _variables(profile: Profile) -> list[tuple[int, str]]:
    return [(i, m) for i, b in enumerate(profile.blocks) for m in useful_modes(b)]


def _program(
    profile: Profile, micro_batches: int, budget: float, cost: np.ndarray
) -> tuple[list[tuple[int, str]], np.ndarray, LinearConstraint | None, LinearConstraint | None, float]:
    """Rows: one choice per block (equality), each event <= budget (scaled to ~1)."""
    var = _variables(profile)
    index = {v: k for k, v in enumerate(var)}
    n = len(profile.blocks)
    choose = np.zeros((n, len(var)))
    for k, (i, _) in enumerate(var):
        choose[i, k] = 1.0
    one = LinearConstraint(choose, 1.0, 1.0) if n else None
    evs = events(profile, micro_batches)
    scale = max(1.0, float(budget))
    rows = np.zeros((len(evs), len(var)))
    rhs = np.zeros(len(evs))
    slack_min = np.inf
    for r, ev in enumerate(evs):
        for i, per_mode in ev.coef.items():
            for m, b in per_mode.items():
                if (i, m) in index:
                    rows[r, index[(i, m)]] = b / scale
        rhs[r] = (budget - ev.const) / scale
        if not ev.coef:
            slack_min = min(slack_min, rhs[r])
    mem = LinearConstraint(rows, -np.inf, rhs) if len(evs) else None
    return var, cost, one, mem, float(slack_min)


def _milp(
    var: list[tuple[int, str]], cost: np.ndarray, constraints: list[LinearConstraint]
) -> list[str] | None:
    if not var:
        return []
    res = milp(
        cost,
        constraints=constraints,
        integrality=np.ones(len(var)),
        bounds=Bounds(0.0, 1.0),
        options={"mip_rel_gap": 0.0, "presolve": True},
    )
    if res.x is None or res.status not in (0,):
        return None
    picked: dict[int, str] = {}
    for k, (i, m) in enumerate(var):
        if res.x[k] > 0.5:
            picked[i] = m
    return [picked[i] for i in range(len(picked))]


def solve(profile: Profile, budget_bytes: int, micro_batches: int = 1) -> Solution | None:
    """The least-time modes whose simulated peak is at or under ``budget_bytes``.

    Args:
        profile: measured per-block costs at one precision.
        budget_bytes: the limit every event of the step must respect.
        micro_batches: gradient-accumulation micro-batches (activations scale down).

    Returns:
        The optimal :class:`Solution`, or None when no choice of modes fits.
    """
    var = _variables(profile)
    times = [block_seconds(b) for b in profile.blocks]
    raw = np.array([times[i][m] for i, m in var], dtype=float)
    # NOTE: the objective is normalised so HiGHS's absolute tolerances mean the same at any
    # scale; a tie between equal-time plans goes to the one listed first (less recompute).
    cost = raw / max(float(raw.max()) if raw.size else 1.0, 1e-12)
    tighten = 0.0
    for _ in range(4):
        var, cost, one, mem, fixed_slack = _program(profile, micro_batches, budget_bytes - tighten, cost)
        if fixed_slack < 0:
            return None
        modes = _milp(var, cost, [c for c in (one, mem) if c is not None])
        if modes is None:
            return None
        peak = simulate(profile, modes, micro_batches).peak_bytes
        if peak <= budget_bytes:
            total = sum(times[i][m] for i, m in enumerate(modes))
            return Solution(modes=modes, peak_bytes=peak, block_seconds=total)
        # NOTE: HiGHS accepts rows violated by up to its feasibility tolerance (~1e-7 of the
        # budget); the exact check caught one, so the row is tightened by the excess.
        tighten += peak - budget_bytes
    return None


def minimum_peak(profile: Profile, micro_batches: int = 1) -> Solution:
    """The modes with the smallest simulated peak (ties: least time), for error messages.

    Minimises ``z`` subject to every event <= ``z``, then re-solves for time at that peak.
    """
    var = _variables(profile)
    evs = events(profile, micro_batches)
    if not var:
        sim = simulate(profile, [], micro_batches)
        return Solution(modes=[], peak_bytes=sim.peak_bytes, block_seconds=0.0)
    index = {v: k for k, v in enumerate(var)}
    scale = float(max(1, max(e.const for e in evs)))
    rows = np.zeros((len(evs), len(var) + 1))
    rhs = np.zeros(len(evs))
    for r, ev in enumerate(evs):
        for i, per_mode in ev.coef.items():
            for m, b in per_mode.items():
                if (i, m) in index:
                    rows[r, index[(i, m)]] = b / scale
        rows[r, -1] = -1.0
        rhs[r] = -ev.const / scale
    choose = np.zeros((len(profile.blocks), len(var) + 1))
    for k, (i, _) in enumerate(var):
        choose[i, k] = 1.0
    cost = np.zeros(len(var) + 1)
    cost[-1] = 1.0
    integrality = np.ones(len(var) + 1)
    integrality[-1] = 0
    res = milp(
        cost,
        constraints=[LinearConstraint(choose, 1.0, 1.0), LinearConstraint(rows, -np.inf, rhs)],
        integrality=integrality,
        bounds=Bounds(np.r_[np.zeros(len(var)), -np.inf], np.r_[np.ones(len(var)), np.inf]),
        options={"mip_rel_gap": 0.0},
    )
    if res.x is None:  # pragma: no cover - the program always has a solution
        raise RuntimeError(f"HiGHS found no minimum-peak plan: {res.message}")
    picked = {i: m for k, (i, m) in enumerate(var) if res.x[k] > 0.5}
    modes = [picked[i] for i in range(len(profile.blocks))]
    peak = simulate(profile, modes, micro_batches).peak_bytes
    best = solve(profile, peak, micro_batches)
    return best if best is not None else Solution(modes, peak, 0.0)
