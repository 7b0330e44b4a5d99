"""The planner prices and chooses offload on synthetic profiles (host-link speeds given).

A chain of equal blocks at long context: kept whole (mode ``none``) a block holds four times
its input, checkpointed (``full``) only its input, for one more forward in its backward. With
a fast link, offloading every block's activations fits where keeping them does not and is
faster than recomputing them, so the plan offloads; with a slow link the copies cost more
than the recompute, and the plan checkpoints instead. On a CPU the lever is refused, with the
reason. The measured side (MemTracker against the price) is tests/test_offload.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memfit.applying import Site, lever
from memfit.applying.registry import usable_levers
from memfit.errors import InfeasibleBudget
from memfit.measuring.long_context import host_link_facts
from memfit.planning.choose import TIE
from memfit.planning.lever_sets import plan_with_levers
from memfit.records import BlockStats, LeverFacts, Profile
from memfit.records.long_context import HostLinkFacts
from memfit.stepmodel import predict_step_seconds, simulate
from memfit.stepmodel.offload import moved_bytes, offload_price

MiB = 2**20
FAST = HostLinkFacts("cuda:0", 20e9, 20e9)
SLOW = HostLinkFacts("cuda:0", 50e6, 50e6)


def _chain(link: HostLinkFacts | None, n: int = 6, x: int = 10 * MiB) -> Profile:
    blocks = [
        BlockStats(
            f"b{i}", param_bytes=MiB, grad_bytes=MiB, output_bytes=x,
            saved_bytes={"none": 4 * x, "full": x}, held_bytes={"none": 4 * x, "full": x},
            forward_peak_bytes={"none": 5 * x, "full": 5 * x},
            backward_peak_bytes={"none": 2 * x, "full": 3 * x},
            forward_seconds=0.010, backward_seconds={"none": 0.020, "full": 0.030},
        )
        for i in range(n)
    ]  # fmt: skip
    outside = BlockStats(
        "outside", saved_bytes={"none": 0, "full": 0}, backward_peak_bytes={"none": 2 * x, "full": 2 * x}
    )
    prof = Profile("bf16", "cuda", 1, blocks, outside, n * MiB, n * MiB, 2 * n * MiB, 0, step_seconds=0.2)
    prof.lever_facts = LeverFacts(host_link=link)
    return prof


def _offloaded(prof: Profile, mode: str) -> int:
    names = [b.name for b in prof.blocks]
    return offload_price(prof, mode, moved_bytes(prof, mode, names), FAST).peak_bytes


def test_offload_is_chosen_where_recompute_costs_more() -> None:
    prof = _chain(FAST)
    budget = _offloaded(prof, "none")
    assert simulate(prof, "none").peak_bytes > budget >= simulate(prof, "full").peak_bytes
    plan, _ = plan_with_levers({"bf16": prof}, budget, (0, 0.0), ["offload"])
    assert plan.levers == ["offload"] and set(plan.blocks.values()) == {"none"}
    names = plan.lever_settings["offload"]["blocks"]
    price = offload_price(prof, "none", moved_bytes(prof, "none", names), FAST)
    assert plan.predicted_peak_bytes == price.peak_bytes <= budget
    assert plan.report.lever_savings["offload"] == simulate(prof, "none").peak_bytes - price.peak_bytes > 0
    recompute = predict_step_seconds(prof, "full")
    assert plan.report.predicted_step_seconds == predict_step_seconds(prof, "none") + price.exposed_seconds
    assert plan.report.predicted_step_seconds < recompute * (1 - TIE)


def test_a_slow_link_leaves_recompute_cheaper() -> None:
    prof = _chain(SLOW)
    budget = _offloaded(_chain(FAST), "none")
    plan, _ = plan_with_levers({"bf16": prof}, budget, (0, 0.0), ["offload"])
    assert plan.levers == [] and set(plan.blocks.values()) == {"full"}
    names = [b.name for b in prof.blocks]
    slow = offload_price(prof, "none", moved_bytes(prof, "none", names), SLOW)
    assert predict_step_seconds(prof, "none") + slow.exposed_seconds > predict_step_seconds(prof, "full")


def test_offload_is_chosen_where_nothing_fits_without_it() -> None:
    prof = _chain(FAST)
    budget = _offloaded(prof, "full")
    assert budget < simulate(prof, "full").peak_bytes  # recompute alone does not fit; batch 1
    with pytest.raises(InfeasibleBudget):
        plan_with_levers({"bf16": prof}, budget, (0, 0.0), [])
    plan, _ = plan_with_levers({"bf16": prof}, budget, (0, 0.0), ["offload"])
    assert plan.levers == ["offload"] and plan.predicted_peak_bytes <= budget
    with pytest.raises(InfeasibleBudget) as info:
        plan_with_levers({"bf16": prof}, budget // 2, (0, 0.0), ["offload"])
    assert info.value.minimum_bytes == min(_offloaded(prof, "none"), budget)


def test_offload_stays_refused_on_a_cpu_with_the_reason() -> None:
    why = lever("offload").refusal(Site(torch.device("cpu"), "AdamW", "fp32"))
    assert why is not None and "CUDA only" in why
    cpu_link = host_link_facts(torch.device("cpu"))
    assert cpu_link.refused
    for link, reason in [(None, "the host link was not measured"), (cpu_link, cpu_link.refused)]:
        allowed, refused = usable_levers({"bf16": _chain(link)}, ["offload"])
        assert allowed == [] and refused == {"offload": reason}


def test_offload_facts_round_trip() -> None:
    facts = LeverFacts(host_link=FAST)
    assert LeverFacts.from_json(facts.to_json()) == facts
    assert dataclasses.replace(facts, host_link=None).host_link is None


def test_the_longest_sequence_search_counts_offload() -> None:
    """``maximize="seq_len"`` asks each probe whether a plan fits with offload too
    (memfit.planning.longest_sequence): where only offloading fits, the length fits."""
    from memfit.planning.longest_sequence import _fits, _least

    prof = _chain(FAST)
    budget = _offloaded(prof, "full")
    assert not _fits(prof, False, budget, 1)  # recompute alone does not fit
    assert _fits(prof, True, budget, 1)
    assert not _fits(prof, True, budget // 2, 1)
    # the smallest step the search reports (one token that does not fit says it) counts offload
    assert _least(prof, False, 1) == simulate(prof, "full").peak_bytes
    assert _least(prof, True, 1) == min(_offloaded(prof, "none"), _offloaded(prof, "full"))
    assert _least(prof, True, 1) < _least(prof, False, 1)
