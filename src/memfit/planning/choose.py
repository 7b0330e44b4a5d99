"""Choose a plan from profiles: the fastest per precision and micro-batch count, ties to counted work.

A pure function over records (:func:`plan_from_profiles`): for one micro-batch, then two,
four... (while a plan in that many could still be the fastest;
See Note [micro-batches where they are faster]), the solver
(:mod:`memfit.planning.solver`) finds each precision's fastest plan; the fastest of those
wins, and plans within :data:`TIE` of the fastest step, or within the measured spread of
the timings (``Speed.spread``) of their checkpointing extras, count as equally fast (the
time model resolves no finer), so the least counted work among them wins (selective
checkpointing's ops, then recomputed FLOPs), then the lowest peak, then the precision
listed first. The answer depends on exact counts wherever time cannot tell: the same
profiles, or profiles whose timings differ by noise, give the same plan
(See Note [plans repeat]).

PyTorch's own configurations come first (:mod:`memfit.planning.standard`): where one fits
and the solver's plan is not predicted :data:`~memfit.planning.standard.PREFER_STANDARD`
of a step faster, the fastest standard configuration that fits is the plan.

Example:
    >>> from memfit.records import BlockStats, Profile
    >>> blk = [BlockStats(f"b{i}", saved_bytes={"none": 100, "full": 10},
    ...        backward_peak_bytes={"none": 50, "full": 150},
    ...        backward_seconds={"none": 1.0, "full": 2.0}) for i in range(2)]
    >>> prof = Profile("fp32", "cpu", 1, blk, BlockStats("outside"), 0, 0, 0, 0)
    >>> plan_from_profiles({"fp32": prof}, 200).blocks
    {'b0': 'full', 'b1': 'none'}
"""

from __future__ import annotations

import typing
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from memfit.budget import format_bytes
from memfit.devices import device_facts, recommend_precision
from memfit.errors import ConfigError, InfeasibleBudget, UnsupportedPrecision
from memfit.planning.solver import Solution, counted_work, minimum_peak, solve
from memfit.planning.standard import PREFER_STANDARD, standard_solutions
from memfit.records import Plan, PlanReport, Profile, Speed
from memfit.stepmodel import Option, block_options, predict_options_seconds, simulate_options, tiling
from memfit.vocab import PRECISIONS, PrecisionName, normalize_modes, normalize_precision

__all__ = [
    "MICRO_CARRIED",
    "NOISE_CAP",
    "TIE",
    "candidate_precisions",
    "considered",
    "fixed_bytes_message",
    "plan_from_profiles",
]

#: Plans whose predicted step time is within this fraction of the fastest count as ties.
TIE = 0.02
#: The most of a plan's checkpointing extra that timing noise can account for: extras more
#: than ``(1 + NOISE_CAP) / (1 - NOISE_CAP)`` (3) times apart are told apart by time however
#: far the timings spread (See Note [plans repeat]).
NOISE_CAP = 0.5
#: How far off what micro-batches add to a plan can be, as a fraction of it, however the
#: rounds agreed: splitting is timed on the whole step in a few counts, taken linear in
#: between, and a recompute pays the step's ratio rather than its block's
#: (See Note [plans repeat]).
MICRO_CARRIED = 0.1


def candidate_precisions(precision: str | Sequence[str], device: torch.device) -> list[PrecisionName]:
    """The precisions to choose from: "auto" = fp32 and what the device runs natively."""
    if isinstance(precision, str):
        if precision == "auto":
            best = recommend_precision(device_facts(device))
            return ["fp32"] if best == "fp32" else ["fp32", best]
        chosen = [precision]
    else:
        chosen = list(precision)
    bad = [p for p in chosen if p not in PRECISIONS]
    if bad or not chosen:
        raise UnsupportedPrecision(
            f"cannot plan with precision {bad or chosen!r}; give 'auto', one of {', '.join(PRECISIONS)}, "
            "or a list of them."
        )
    return [typing.cast(PrecisionName, p) for p in dict.fromkeys(chosen)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, max(1, n) + 1) if n % d == 0] or [1]


def fixed_bytes_message(fixed: int, budget: int, optimizer: str, detail: str = "") -> str:
    """The sentence for a budget under parameters + gradients + optimizer state."""
    opt = optimizer if optimizer not in ("", "none") else "optimizer"
    return (
        f"no plan fits the budget: parameters + gradients + {opt} state alone take {format_bytes(fixed)}; "
        f"budget {format_bytes(budget)}{detail}: use a smaller model, an optimizer with less state, or more "
        "memory."
    )


def _explain(precision: str, micro: int, sol: Solution, profiles: Mapping[str, Profile], budget: int) -> str:
    prof = profiles[precision]
    sim = simulate_options(prof, sol.options, micro)
    # "Alone" is what every step holds whatever the plan; the optimizer step's temporaries
    # are not held all step (a fused or for-loop step changes them), so they are named apart.
    state = prof.param_bytes + prof.grad_bytes + prof.optimizer_bytes
    if state >= budget:
        return fixed_bytes_message(state, budget, prof.optimizer)
    opt = prof.optimizer if prof.optimizer not in ("", "none") else "optimizer"
    if state + prof.optimizer_temp_bytes >= budget:
        return (
            f"no plan fits the budget: parameters + gradients + {opt} state take {format_bytes(state)} and "
            f"the optimizer step {format_bytes(prof.optimizer_temp_bytes)} more while it runs; budget "
            f"{format_bytes(budget)}: use an optimizer with less state (or a fused or for-loop step), or "
            "more memory."
        )
    return (
        f"no plan fits the budget: even at {precision} with every block at its smallest and {micro} "
        f"micro-batch(es), the step peaks at {format_bytes(sim.peak_bytes)} during the {sim.peak_event} "
        f"(parameters + gradients + {opt} state {format_bytes(state)}, activations and "
        f"temporaries {format_bytes(sim.peak_bytes - state)}); budget {format_bytes(budget)}: "
        "raise the budget or shrink the model or sequence."
    )


def _step_seconds(profiles: Mapping[str, Profile]) -> float:
    return max((p.step_seconds for p in profiles.values()), default=0.0)


# Note [plans repeat]
# The time model's prices (a recompute's, a checkpoint call's, selective checkpointing's
# per op) are timed, and on a loaded machine they swing by tens of percent from one call
# to the next, while the counts they price (FLOPs, bytes, ops) are exact. So a difference
# in predicted time counts only where it is larger than the timings could make it: the
# rounds of the block timed alone give the spread of the extras each price was fitted to
# (Speed.spreads, half their range over their median; 1 where a fit was clamped), and two
# plans tie where their times differ by less than TIE of a step plus each plan's band. In
# the solver, the band is the largest spread (Speed.spread) of both plans' extras over the
# whole batch at its cheapest (solver.as_fast: a price off by that fraction moves each
# extra by as much). In the final choice, each plan's checkpointing extras take the spread
# of the prices they use: a selective extra of 1% of a block, fitted to rounds within 4% of
# the block, spreads 1.0, and that says nothing about a plan that only recomputes whole
# blocks. Every band is at least the machine's noise (Speed.noise): how far the rounds
# moved a time as a share of it (a mode over none in one round, none's own times across
# the rounds and the step's split rounds, the whole steps across the profile; a few rounds
# can agree by chance, so every set counts; See Note [a load that moves]). What
# micro-batches cost is timed as the step in them over the step whole, round by round, so
# a plan in micro-batches is uncertain, as a whole time, by the spread of the rounds of the
# counts it is priced from (Speed.micro_spreads) or the machine's noise, whichever is
# larger, plus MICRO_CARRIED of what splitting adds (the counts between those timed are
# interpolated). NOISE_CAP does not bound that band: no count orders a split against a
# checkpoint. Two plans in micro-batches of one precision are priced from the same split
# rounds, so an error there moves both the same way: between them that band counts once
# (the larger), not once each. Counted twice, it tied 2 micro-batches recomputing 3 blocks
# of the ResNet-18-style CNN at 60% with 4 recomputing nothing (the 2 predicted and
# measured 12% slower) in 3 calls of 4 (issue 36); counted once, in 1 call of 9,
# where the machine moved a time by 7% (there the two still tie). So
# micro-batches replace a whole-batch plan only where clearly faster: on a quiet
# machine, by more than a few percent of the step (the GPT 6 x 384 at 70%: 11% faster,
# against a band of about 8% of the step); with both cores busy, by more than the 30-60%
# the load moves a time (measured on the README's GPT).
# Among ties the key is exact: the fewest micro-batches, then the least counted work
# (solver.counted_work: first the ops selective checkpointing dispatches, the price a CPU
# makes dearest and FLOPs do not see, then the FLOPs recomputed, FlopCounterMode's
# counts; micro-batches count every forward op they dispatch again with selective's ops),
# then the lowest peak, then the precision listed first (and, in the solver, a fixed order
# of blocks and modes). Counted work orders plans only one count after the
# other and prices no checkpoint call, so the spread is taken at most NOISE_CAP: extras
# three times apart stay told apart by time. On a quiet machine the spread is small and
# time decides as before; on a loaded one the band widens and counted work decides, and
# what counts cannot tell apart (a checkpoint call more or less: a segment) goes to the
# lowest peak. PyTorch's own configurations are preferred over a plan of the solver's
# predicted at most PREFER_STANDARD faster, the noise counted the way the counts point:
# for a configuration with no more counted work, within PREFER_STANDARD plus the noise;
# with more, only within PREFER_STANDARD less the noise (so on a loaded machine the plan
# that does less keeps its exact advantage). The same call then gives the same plan, on
# adapters as on full fine-tuning, wherever plans differ either clearly more than the
# noise or not at all in what is counted; only a difference near the edge of the band can
# still fall either way.


# Note [a load that moves]
# On a loaded machine the load does not hold still: measured on this project's 2-core
# machine with two spinning processes started, a small LoRA step ran in 0.03-0.14 s for
# the first seconds and then in 1.27 s, and what splitting costs moved with it (2
# micro-batches 1.54x the step whole, then 2.0x). The step's split rounds and the block's
# rounds alone run at different moments of the profile, so a plan in micro-batches (priced
# from the one) set against checkpointing (priced from the other) compares two moments of
# the load; so do two checkpointing plans whose prices were fitted at one moment, where
# the rounds happened to agree. The whole steps timed across the profile (at its start and
# between) see the load move: their spread, outliers kept (one step apart is the load
# moving, not noise to drop), widens Speed.spread where it is larger than the rounds' own,
# so a plan replaces another only where it is faster at every moment the profile saw. On
# a quiet machine those steps differ by 0.01-0.15 of their median (measured here), about as
# far as the rounds do. What this does not catch: a price off while every timing agreed.
# On a 3-block GPT of 16-128 tokens with every core busy, a checkpoint call was once priced
# at a quarter of a 0.0086 s step while the rounds and whole steps agreed within a tenth,
# and a segment (one call fewer) beat "every 2nd block" in 1 call of 15 or so; on a step
# of 0.035 s (64 wide, 512 tokens) 15 triples of calls under the same load kept one plan each.


class _Found(NamedTuple):
    """A candidate plan, with what the choice among candidates reads."""

    seconds: float
    """Predicted step seconds."""
    uncertain: float
    """How far timing noise can move them: checkpointing's extra over every block at its
    cheapest, times the spread of the prices it uses (at most :data:`NOISE_CAP`), and, in
    micro-batches, the whole time times its counts' spread (at most 1), each at least the
    machine's noise; plus :data:`MICRO_CARRIED` of what micro-batches add.
    See Note [plans repeat]."""
    work: tuple[int, int]
    """What its options add, counted (:func:`~memfit.planning.solver.counted_work`), and the
    forward ops its micro-batches after the first dispatch again (with selective's ops)."""
    peak: int
    rank: int
    """The precision's place in the order given."""
    precision: str
    sol: Solution
    micro: int = 1
    """Micro-batches."""
    split_band: float = 0.0
    """The part of ``uncertain`` its micro-batches' whole time takes from the split rounds'
    spread (0 for the batch whole): shared with every plan of its precision in micro-batches."""


def _cheapest(prof: Profile) -> list[Option]:
    """Every block at its cheapest mode, budget aside."""
    return tiling(prof, [(block_options(b) or ["none"])[0] for b in prof.blocks])


def _count_spread(sp: Speed, micro: int) -> float:
    """The spread of the rounds a step in ``micro`` micro-batches is priced from: the counts
    timed either side of it (its own where it was timed; the last beyond them)."""
    timed = list(zip(sp.micro_batches, sp.micro_spreads, strict=False))
    below = [s for k, s in timed if k <= micro][-1:]
    above = [s for k, s in timed if k >= micro][:1]
    return max(below + above, default=0.0)


def _uncertain(
    sp: Speed, sol: Solution, micro: int, seconds: float, whole: float, extra: float
) -> tuple[float, float]:
    """How far timing noise can move a plan's ``seconds`` (See Note [plans repeat]): its
    checkpointing ``extra`` by the spread of the prices they use, and a plan in micro-batches
    as a whole by its counts' rounds; each at least by how far the machine moved a time. The
    second number is that last part, the split band."""
    # a block in a segment is "full" among sol.modes
    extras = max((sp.spreads.get(m, sp.spread) for m in set(sol.modes) - {"none"}), default=0.0)
    # the cap keeps checkpointing extras three times apart told apart; a split has no such count
    band = min(NOISE_CAP, max(sp.noise, extras)) * extra
    if micro <= 1:
        return band, 0.0
    split = min(1.0, max(sp.noise, _count_spread(sp, micro))) * seconds
    carried = MICRO_CARRIED * max(0.0, seconds - whole)  # interpolated between the counts timed
    return band + split + carried, split


def _found(prof: Profile, precision: str, rank: int, sol: Solution, micro: int, peak: int = -1) -> _Found:
    seconds = predict_options_seconds(prof, sol.options, micro)
    whole = predict_options_seconds(prof, sol.options, 1)
    checkpointing = max(0.0, whole - predict_options_seconds(prof, _cheapest(prof), 1))
    sp = prof.speed
    uncertain, split = (0.0, 0.0) if sp is None else _uncertain(sp, sol, micro, seconds, whole, checkpointing)
    counted = [counted_work(prof, o) for o in sol.options]
    # each micro-batch after the first dispatches every forward op again (See Note [plans repeat])
    repeated = (micro - 1) * (sum(b.forward_ops for b in prof.blocks) + prof.outside.forward_ops)
    work = (sum(c[0] for c in counted) + repeated, sum(c[1] for c in counted))
    peak = sol.peak_bytes if peak < 0 else peak
    return _Found(seconds, uncertain, work, peak, rank, precision, sol, micro, split)


def _noise(prof: Profile) -> float:
    return min(NOISE_CAP, prof.speed.spread) if prof.speed is not None else 0.0


def _noise_of_both(a: _Found, b: _Found) -> float:
    """How far timing noise can move two plans apart: both bands, the split band once where
    both are in micro-batches of one precision (priced from the same split rounds, an error
    there moves both the same way; See Note [plans repeat])."""
    shared = min(a.split_band, b.split_band) if a.precision == b.precision else 0.0
    return a.uncertain + b.uncertain - shared


def _ties(fastest: _Found, other: _Found, tie: float) -> bool:
    """Whether ``other`` is as fast as ``fastest``: slower by at most ``tie`` plus what the
    noise can move both (the rule of :func:`~memfit.planning.solver.as_fast`)."""
    return other.seconds - fastest.seconds <= tie + _noise_of_both(fastest, other)


def _near(custom: _Found, standard: _Found, prefer: float) -> bool:
    """Whether ``standard`` is the plan rather than ``custom``: at most ``prefer`` slower, the
    timing noise counted in its favour where its counted work is no more, against it where
    it is more (See Note [plans repeat])."""
    noise = _noise_of_both(custom, standard)
    slower = standard.seconds - custom.seconds
    return slower <= prefer + (noise if standard.work <= custom.work else -noise)


def _pick(custom: list[_Found], standard: list[_Found], tie: float, prefer: float) -> _Found:
    """The plan to return: a standard configuration unless the solver's is ``prefer`` faster.

    Within the pool chosen, plans that tie its fastest are equally fast, and the fewest
    micro-batches win, then the fewest counted work, then the lowest peak, then the
    precision listed first (See Note [plans repeat]).
    """
    fastest = min(custom, key=lambda f: f.seconds, default=None)
    near = [f for f in standard if fastest is None or _near(fastest, f, prefer)]
    pool = near or custom
    best = min(pool, key=lambda f: f.seconds)
    return min((f for f in pool if _ties(best, f, tie)), key=lambda f: (f.micro, f.work, f.peak, f.rank))


def _candidates(
    profiles: Mapping[str, Profile], budget: int, micro: int, tie: float, segments: bool, baseline: int
) -> tuple[list[_Found], list[_Found]]:
    """Each precision's fastest plan at ``micro`` micro-batches (the solver's), and PyTorch's
    own configurations, that fit ``budget``."""
    found: list[_Found] = []
    standard: list[_Found] = []
    for rank, (precision, prof) in enumerate(profiles.items()):
        sol = solve(prof, budget, micro, tie_seconds=tie, segments=segments, noise=_noise(prof))
        if sol is not None:
            found.append(_found(prof, precision, rank, sol, micro))
        for _, std in standard_solutions(prof, budget, micro, segments=segments):
            standard.append(_found(prof, precision, rank, std, micro))
        if micro == 1 and precision == "fp32" and 0 < baseline <= budget:
            # Note [the measured baseline]
            # Keeping every block was measured (the baseline); where it fits, it is a plan,
            # even where the step model, adding up per-block numbers, predicts a little more.
            found.append(_found(prof, precision, rank, _keep_all(prof, baseline), 1, baseline))
            standard.append(found[-1])
    return found, standard


def _cannot_win(profiles: Mapping[str, Profile], micro: int, best: _Found, tie: float) -> bool:
    """Whether no plan at ``micro`` micro-batches can tie ``best``: even every block at its
    cheapest mode, budget aside, is slower by more than the noise (and what micro-batches add
    only grows with their number: See Note [what a micro-batch costs])."""
    for rank, (precision, prof) in enumerate(profiles.items()):
        options = _cheapest(prof)
        least = Solution([], 0, 0.0, options=options)
        if _ties(best, _found(prof, precision, rank, least, micro), tie):
            return False
    return True


# Note [micro-batches where they are faster]
# Splitting the batch costs what each micro-batch repeats
# (See Note [what a micro-batch costs] in memfit/stepmodel/time.py) and saves
# activations, so a plan in micro-batches can be faster than any whole-batch plan that
# fits (checkpointing every block recomputes more than four micro-batches repeat). Every
# micro-batch count is therefore a candidate, not only where nothing fits whole: from one
# up, until even the cheapest plan at that count (every block at its cheapest, budget
# aside) cannot tie the fastest found, since what micro-batches add grows with their
# number. Each count's plan is picked among that count's candidates (the solver's and
# PyTorch's own configurations, as for the batch whole), and replaces the plan of fewer
# micro-batches only where it is faster beyond what the noise can move both: a plan in
# micro-batches, uncertain by its rounds' spread of its whole time, neither wins a tie nor
# makes PyTorch's configurations look as fast as a whole-batch plan clearly faster than
# them. So among plans that tie, the fewest micro-batches win (the step is the user's step;
# BatchNorm sees the whole batch), and the forward ops they dispatch again count as work.
# A profile without a time model (Profile.speed None: an estimate, a profile built by
# hand) cannot price a micro-batch, so there the batch is split only where nothing fits
# it whole.


def _plan(chosen: _Found, profiles: Mapping[str, Profile], budget: int, baseline: tuple[int, float]) -> Plan:
    prof, sol = profiles[chosen.precision], chosen.sol
    names = [b.name for b in prof.blocks]
    return Plan(
        blocks=normalize_modes(dict(zip(names, sol.modes, strict=True))),
        segments=[names[a : b + 1] for a, b in sol.segments],
        precision=normalize_precision(chosen.precision),
        micro_batches=chosen.micro,
        report=PlanReport(
            predicted_peak_bytes=sol.peak_bytes,
            predicted_step_seconds=chosen.seconds,
            baseline_peak_bytes=baseline[0],
            baseline_step_seconds=baseline[1],
            budget_bytes=budget,
        ),
    )


def _search(
    profiles: Mapping[str, Profile], budget: int, baseline: int, segments: bool, split: bool
) -> tuple[list[_Found], _Found | None]:
    """Every candidate considered, and the one chosen (None: nothing fits).

    See Note [micro-batches where they are faster].
    """
    batch = max(p.batch_size for p in profiles.values()) if split else 1
    tie = TIE * _step_seconds(profiles)
    prefer = PREFER_STANDARD * _step_seconds(profiles)
    found: list[_Found] = []
    standard: list[_Found] = []
    best: _Found | None = None
    priced = all(p.speed is not None for p in profiles.values())
    for micro in _divisors(batch):
        if best is not None and (not priced or _cannot_win(profiles, micro, best, tie)):
            break
        more, more_standard = _candidates(profiles, budget, micro, tie, segments, baseline)
        found, standard = found + more, standard + more_standard
        if more or more_standard:
            here = _pick(more, more_standard, tie, prefer)
            if best is None or (here.seconds < best.seconds and not _ties(here, best, tie)):
                best = here
    return found + standard, best


def considered(
    profiles: Mapping[str, Profile],
    budget_bytes: int,
    baseline_peak_bytes: int = 0,
    baseline_step_seconds: float = 0.0,
    *,
    segments: bool = True,
) -> list[Plan]:
    """Every plan :func:`plan_from_profiles` weighs for this budget (each precision's and micro-batch
    count's fastest of the solver's, and PyTorch's own configurations that fit), each once, fastest
    predicted first: what a benchmark times to check the choice (``benchmarks/bench_time_model.py``).

    Example:
        >>> from memfit.records import BlockStats, Profile
        >>> blk = [BlockStats(f"b{i}", saved_bytes={"none": 100, "full": 10},
        ...        backward_peak_bytes={"none": 50, "full": 150},
        ...        backward_seconds={"none": 1.0, "full": 2.0}) for i in range(2)]
        >>> prof = Profile("fp32", "cpu", 1, blk, BlockStats("outside"), 0, 0, 0, 0)
        >>> [p.blocks for p in considered({"fp32": prof}, 200)]
        [{'b0': 'full', 'b1': 'none'}, {'b0': 'full', 'b1': 'full'}]
    """
    seen: dict[str, Plan] = {}
    found, _ = _search(profiles, budget_bytes, baseline_peak_bytes, segments, True)
    baseline = (baseline_peak_bytes, baseline_step_seconds)
    for f in sorted(found, key=lambda f: (f.seconds, f.micro, f.rank)):
        plan = _plan(f, profiles, budget_bytes, baseline)
        seen.setdefault(repr((plan.blocks, plan.segments, plan.precision, plan.micro_batches)), plan)
    return list(seen.values())


def plan_from_profiles(
    profiles: Mapping[str, Profile],
    budget_bytes: int,
    baseline_peak_bytes: int = 0,
    baseline_step_seconds: float = 0.0,
    *,
    segments: bool = True,
    split: bool = True,
) -> Plan:
    """The least-time plan over precisions and micro-batch counts (a pure function).

    Args:
        profiles: one measured profile per allowed precision (in order of preference).
        budget_bytes: the peak every event of the step must stay under.
        baseline_peak_bytes: the fp32, no-checkpointing peak (recorded in the Plan).
        baseline_step_seconds: its step time (for the predicted time ratio).
        segments: also consider segments of blocks checkpointed as one.
        split: also consider micro-batches (False: the batch computed at once, as the
            largest-batch search asks).

    Returns:
        The :class:`Plan` with its predicted peak and step time.

    Raises:
        InfeasibleBudget: nothing fits, even at one sample per micro-batch.
    """
    if not profiles:
        raise ConfigError("no profiles to plan from; profile the model at one precision at least.")
    baseline = (baseline_peak_bytes, baseline_step_seconds)
    _, best = _search(profiles, budget_bytes, baseline_peak_bytes, segments, split)
    if best is not None:
        return _plan(best, profiles, budget_bytes, baseline)
    batch = max(p.batch_size for p in profiles.values()) if split else 1
    # The smallest peak of every plan considered (each precision and micro-batch count) and of
    # keeping every block: never above any of them.
    # See Note [the measured baseline]
    p, micro, least = min(
        (
            (p, micro, minimum_peak(prof, micro, segments=segments))
            for p, prof in profiles.items()
            for micro in _divisors(batch)
        ),
        key=lambda t: (t[2].peak_bytes, t[1]),
    )
    minimum = min(least.peak_bytes, baseline_peak_bytes) if baseline_peak_bytes > 0 else least.peak_bytes
    raise InfeasibleBudget(
        _explain(p, micro, least, profiles, budget_bytes), minimum_bytes=minimum, budget_bytes=budget_bytes
    )


def _keep_all(prof: Profile, peak: int) -> Solution:
    """Every block kept (mode none), with its measured peak."""
    options = tiling(prof, "none")
    return Solution(["none"] * len(prof.blocks), peak, 0.0, options=options)
