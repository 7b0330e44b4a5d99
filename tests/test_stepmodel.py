"""One step model: profile, estimate and plan report the same peak for any mix of modes.

``memfit profile`` and ``memfit estimate`` add their numbers up with
:func:`memfit.stepmodel.simulate`; the planner's solver constrains
:func:`memfit.stepmodel.events`. These tests hold the three to one answer: on random
synthetic profiles (hypothesis) and on a real model's measured and fake-tensor profiles.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_gpt, token_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from synthetic_profiles import profiles

import memfit
from memfit.models.gpt import gpt_loss
from memfit.planning.choose import plan_from_profiles
from memfit.records import BREAKDOWN_KEYS, Profile
from memfit.stepmodel import all_options, block_options, events, simulate, tiling

#: Fake-tensor estimate vs measured profile of the same model: MemTracker counts the same
#: tensors either way; the estimate is within 0.2% of measurement on the test models.
ESTIMATE_RTOL = 0.01


def _random_plan(profile: Profile, rng: random.Random) -> tuple[list[str], list[tuple[int, int]]]:
    """Random modes, and a random segment where the chain links allow one."""
    modes = [rng.choice(block_options(b)) for b in profile.blocks]
    segs = [(o.first, o.last) for o in all_options(profile) if o.segment]
    return modes, [rng.choice(segs)] if segs and rng.random() < 0.7 else []


@settings(max_examples=80, deadline=None)
@given(profile=profiles(max_blocks=6), seed=st.integers(0, 2**16), micro=st.sampled_from([1, 2, 3]))
def test_simulate_breakdown_and_solver_rows_agree(profile: Profile, seed: int, micro: int) -> None:
    modes, segs = _random_plan(profile, random.Random(seed))
    sim = simulate(profile, modes, micro, segs)
    assert sorted(sim.breakdown) == sorted(BREAKDOWN_KEYS)
    assert sum(sim.breakdown.values()) == sim.peak_bytes
    # the solver's linear rows over every option: const + the chosen options' terms
    chosen = tiling(profile, modes, segs)
    rows = [e.const + sum(e.coef.get(o, 0) for o in chosen) for e in events(profile, micro)]
    assert max(rows) == sim.peak_bytes
    assert sim.breakdown["params"] == profile.param_bytes
    assert sim.breakdown["optimizer"] == profile.optimizer_bytes


@settings(max_examples=40, deadline=None)
@given(profile=profiles(max_blocks=6), seed=st.integers(0, 2**16))
def test_the_planner_predicts_what_simulate_says(profile: Profile, seed: int) -> None:
    modes, segs = _random_plan(profile, random.Random(seed))
    budget = simulate(profile, modes, 1, segs).peak_bytes
    plan = plan_from_profiles({"fp32": profile}, budget)
    got = simulate(profile, plan.blocks, plan.micro_batches, plan.segments).peak_bytes
    assert plan.predicted_peak_bytes == got <= budget


@pytest.fixture(scope="module")
def gpt_profiles() -> tuple[Profile, Profile]:
    model = tiny_gpt(n_layer=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = token_batch(4, 16)
    measured = memfit.profile(model, batch, gpt_loss, opt, repeats=1)
    est = memfit.estimate(
        lambda: tiny_gpt(n_layer=4),
        batch,
        gpt_loss,
        lambda p: torch.optim.AdamW(p, lr=1e-3),
        precisions=["fp32"],
    )
    return measured, est.profiles["fp32"]


def test_profile_and_estimate_give_the_same_peak_for_random_mixed_plans(gpt_profiles) -> None:  # type: ignore[no-untyped-def]
    measured, estimated = gpt_profiles
    rng = random.Random(0)
    for _ in range(12):
        modes = {b.name: rng.choice(block_options(b)) for b in measured.blocks}
        for micro in (1, 2):
            a = simulate(measured, modes, micro)
            b = simulate(estimated, modes, micro)
            assert b.peak_bytes == pytest.approx(a.peak_bytes, rel=ESTIMATE_RTOL), (modes, micro)
            assert a.peak_event == b.peak_event, (modes, micro)
    # the estimate's uniform entries are the same model's numbers
    est_entry = simulate(estimated, "full")
    assert est_entry.peak_bytes == pytest.approx(simulate(measured, "full").peak_bytes, rel=ESTIMATE_RTOL)


def test_keep_is_still_read_as_none(gpt_profiles) -> None:  # type: ignore[no-untyped-def]
    measured, _ = gpt_profiles
    old = {b.name: "keep" for b in measured.blocks}
    assert simulate(measured, old).peak_bytes == simulate(measured, "none").peak_bytes
    plan = memfit.Plan.from_json('{"blocks": {"blocks.0": "keep", "blocks.1": "full"}}')
    assert plan.blocks == {"blocks.0": "none", "blocks.1": "full"}
    assert '"keep"' not in plan.to_json()
