"""Plans that offload activations to host memory: priced by the step model, chosen by time.

The ``offload`` lever moves what a run of blocks keeps for its backward to pinned host memory
and brings it back one block ahead (:mod:`memfit.levers.offload`). Its price is not a change
of one block's numbers but of every moment after the next offloaded block has run
(:func:`memfit.stepmodel.offload.offload_price`), so a lever set with it is planned here:
for each precision, micro-batch count and checkpointing mode (one for every block), the
fewest leading blocks offloaded whose step fits the budget, priced at the host link's
measured speeds; the fastest of those (its copies' exposed time added) is the plan
(See Note [offload against recompute]).

Trade-off: a mode for every block and a leading run of blocks offloaded, not every per-block
combination: the choice is a few hundred prices, each a walk of the step's events.

Example:
    >>> from memfit.records import BlockStats, LeverFacts, Profile
    >>> from memfit.records.long_context import HostLinkFacts
    >>> blocks = [BlockStats(f"b{i}", saved_bytes={"none": 400, "full": 100},
    ...     held_bytes={"none": 400, "full": 100}, forward_peak_bytes={"none": 500, "full": 300},
    ...     backward_peak_bytes={"none": 500, "full": 900}, output_bytes=100, forward_seconds=0.01,
    ...     backward_seconds={"none": 0.02, "full": 0.03}) for i in range(4)]
    >>> prof = Profile("fp32", "cuda", 1, blocks, BlockStats("outside", saved_bytes={"none": 0},
    ...     backward_peak_bytes={"none": 0}), 0, 0, 0, 0, step_seconds=0.2)
    >>> prof.lever_facts = LeverFacts(host_link=HostLinkFacts("cuda:0", 1e6, 1e6))
    >>> plan = plan_offloaded({"fp32": prof}, 1400, (0, 0.0))
    >>> plan.blocks, plan.lever_settings
    ({'b0': 'none', 'b1': 'none', 'b2': 'none', 'b3': 'none'}, {'offload': {'blocks': ['b0', 'b1', 'b2']}})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from memfit.applying.offload import OFFLOAD
from memfit.budget import format_bytes
from memfit.errors import ConfigError, InfeasibleBudget
from memfit.records import Plan, PlanReport, Profile
from memfit.records.long_context import HostLinkFacts
from memfit.stepmodel import block_options, predict_step_seconds
from memfit.stepmodel.offload import OffloadPrice, moved_bytes, offload_price
from memfit.vocab import normalize_modes, normalize_precision

__all__ = ["host_link", "offloaded_peak", "plan_offloaded"]

# Note [offload against recompute]
# Offloading and recomputing both take a block's kept bytes off the device; recompute pays a
# forward of the block again, offload pays the copies the blocks around it do not hide (its
# exposed seconds: memfit.stepmodel.offload). A smaller step (more micro-batches) pays
# nothing in counted work here but splits the batch. So the planner prices both: a lever set
# with offload is planned by the least predicted time over modes (no recompute first) and
# micro-batch counts, offload's exposed copy time included, and planning.lever_sets takes it
# over the same set without offload where it is faster by more than the planner's tie
# (choose.TIE of a step): where recompute costs more than the copies, offload wins; on a
# slow link, or where nothing is to be saved, the plan without it.


@dataclass(frozen=True)
class _Candidate:
    precision: str
    mode: str
    micro: int
    blocks: list[str]
    price: OffloadPrice
    seconds: float


def host_link(profile: Profile) -> HostLinkFacts:
    """The host link the profile's lever facts measured.

    Raises:
        ConfigError: it was not measured, or offload is refused there (one sentence).
    """
    facts = profile.lever_facts
    link = facts.host_link if facts is not None else None
    if link is None:
        raise ConfigError("offload cannot be priced: the host link was not measured; plan again.")
    if link.refused:
        raise ConfigError(f"offload cannot be priced: {link.refused}")
    return link


def offloaded_peak(profile: Profile, plan: Plan) -> int:
    """The predicted peak of ``plan`` (with offload among its levers) on ``profile`` (under the
    plan's other levers)."""
    blocks = plan.setting(OFFLOAD.name, "blocks", [])
    moved = moved_bytes(profile, plan.blocks, blocks)
    return offload_price(profile, plan.blocks, moved, host_link(profile), plan.micro_batches).peak_bytes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, max(n, 1) + 1) if n % d == 0]


def _fewest(prof: Profile, mode: str, micro: int, budget: int, link: HostLinkFacts) -> _Candidate | None:
    """The fewest leading blocks offloaded at ``mode`` whose step fits ``budget``, or None."""
    names = [b.name for b in prof.blocks]
    seconds = predict_step_seconds(prof, mode, micro)
    for k in range(2, len(names) + 1):  # one block offloaded alone saves nothing
        moved = moved_bytes(prof, mode, names[:k])
        price = offload_price(prof, mode, moved, link, micro)
        if price.peak_bytes <= budget:
            return _Candidate(prof.precision, mode, micro, names[:k], price, seconds + price.exposed_seconds)
    return None


def _smallest(profiles: Mapping[str, Profile]) -> int:
    """The smallest offloaded peak of any mode and micro-batch count (every block offloaded)."""
    best = 2**63
    for prof in profiles.values():
        link, names = host_link(prof), [b.name for b in prof.blocks]
        for micro in _divisors(prof.batch_size):
            for mode in _modes(prof):
                price = offload_price(prof, mode, moved_bytes(prof, mode, names), link, micro)
                best = min(best, price.peak_bytes)
    return best


def _modes(prof: Profile) -> list[str]:
    """The modes every block was profiled in, no recompute first."""
    common = [m for m in block_options(prof.blocks[0])] if prof.blocks else []
    return [m for m in common if all(m in block_options(b) for b in prof.blocks)]


def plan_offloaded(
    profiles: Mapping[str, Profile], budget_bytes: int, baseline: tuple[int, float], split: bool = True
) -> Plan:
    """The fastest plan that fits ``budget_bytes`` with leading blocks offloaded (See Note
    [offload against recompute]); ``profiles`` are under the rest of the lever set already
    (``split``: micro-batches allowed, else the batch whole).

    Raises:
        InfeasibleBudget: no mode, micro-batch count or run of blocks offloaded fits (the
            smallest offloaded peak named).
        ConfigError: a profile's host link was not measured, or offload is refused there.
    """
    found = [
        c
        for prof in profiles.values()
        if prof.blocks
        for micro in (_divisors(prof.batch_size) if split else [1])
        for mode in _modes(prof)
        if (c := _fewest(prof, mode, micro, budget_bytes, host_link(prof))) is not None
    ]
    if not found:
        smallest = _smallest(profiles)
        raise InfeasibleBudget(
            f"no plan fits {format_bytes(budget_bytes)} with activations offloaded to host memory; "
            f"the smallest offloaded step needs {format_bytes(smallest)}.",
            minimum_bytes=smallest,
            budget_bytes=budget_bytes,
        )
    best = min(found, key=lambda c: (c.seconds, c.micro, c.price.host_bytes))
    prof = profiles[best.precision]
    return Plan(
        blocks=normalize_modes({b.name: best.mode for b in prof.blocks}),
        precision=normalize_precision(best.precision),
        micro_batches=best.micro,
        levers=[OFFLOAD.name],
        lever_settings={OFFLOAD.name: {"blocks": best.blocks}},
        report=PlanReport(
            predicted_peak_bytes=best.price.peak_bytes,
            predicted_step_seconds=best.seconds,
            baseline_peak_bytes=baseline[0],
            baseline_step_seconds=baseline[1],
            budget_bytes=budget_bytes,
        ),
    )
