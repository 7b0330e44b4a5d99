"""PyTorch's own configurations: priced like any plan, preferred unless a plan of memfit's own
is predicted clearly faster, and the same peak as the strategy they name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import tiny_gpt, token_batch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import memfit
from memfit.benchmarking.sequential import install_sequential, uninstall_sequential
from memfit.checkpointing.layers import set_forward_layer
from memfit.models.gpt import gpt_loss
from memfit.planning.choose import TIE, plan_from_profiles
from memfit.planning.notes import standard_note
from memfit.planning.solver import solve
from memfit.planning.standard import PREFER_STANDARD, sqrt_segments, standard_name, standard_tilings
from memfit.records import BlockStats, Plan, Profile
from memfit.stepmodel import predict_options_seconds, simulate, tiling


def _block(name: str, full_seconds: float = 3.0, selective_seconds: float = 2.6) -> BlockStats:
    return BlockStats(
        name,
        saved_bytes={"none": 1000, "selective": 150, "full": 100},
        backward_peak_bytes={"none": 800, "selective": 900, "full": 1000},
        forward_seconds=1.0,
        backward_seconds={"none": 2.0, "selective": selective_seconds, "full": full_seconds},
    )


def _profile(n: int, chain: bool = True, **kw: float) -> Profile:
    return Profile(
        precision="fp32",
        device="cpu",
        batch_size=4,
        blocks=[_block(f"b{i}", **kw) for i in range(n)],
        outside=BlockStats("outside", saved_bytes={"none": 100}, backward_peak_bytes={"none": 100}),
        param_bytes=1000,
        grad_bytes=1000,
        optimizer_bytes=2000,
        optimizer_temp_bytes=0,
        step_seconds=3.0 * n + 1.0,
        chain_links=[chain] * (n - 1),
    )


@pytest.mark.parametrize("n", [2, 3, 4, 6, 9, 12, 16])
def test_sequential_is_checkpoint_sequentials_split(n: int) -> None:
    # checkpoint_sequential(functions, k, x): n // k functions per segment, the last segment
    # (with the remainder) runs without checkpointing.
    prof = _profile(n)
    k = sqrt_segments(n)
    size = n // k
    tilings = standard_tilings(prof)
    seq = tilings.get("sequential") or tilings["every2"]  # with size 1 it is every 2nd's or full's
    checkpointed = {j for o in seq if o.segment or o.mode == "full" for j in range(o.first, o.last + 1)}
    assert checkpointed == set(range((k - 1) * size))
    assert all(o.last - o.first + 1 == size for o in seq if o.segment)


def test_the_standard_configurations_and_when_they_are_left_out() -> None:
    prof = _profile(4)
    assert list(standard_tilings(prof)) == ["none", "full", "every2", "sequential", "selective"]
    assert [o.mode for o in standard_tilings(prof)["every2"]] == ["full", "none", "full", "none"]
    assert "sequential" not in standard_tilings(_profile(4, chain=False))  # not one chain
    assert "sequential" not in standard_tilings(prof, segments=False)
    no_selective = _profile(4)
    for b in no_selective.blocks:
        del b.saved_bytes["selective"], b.backward_peak_bytes["selective"]
    assert "selective" not in standard_tilings(no_selective)
    assert standard_name(prof, ["full", "full", "none", "none"], [["b0", "b1"]]) == "sequential"
    assert standard_name(prof, ["full", "none", "none", "none"]) is None


def _custom_and_standard(prof: Profile, budget: int) -> tuple[float, float]:
    """Predicted seconds of the solver's own plan and of the fastest standard one that fits."""
    sol = solve(prof, budget)
    assert sol is not None
    std = [
        predict_options_seconds(prof, opts)
        for opts in standard_tilings(prof).values()
        if simulate(
            prof, [o.mode for o in opts], segments=[(o.first, o.last) for o in opts if o.segment]
        ).peak_bytes
        <= budget
    ]
    return predict_options_seconds(prof, sol.options), min(std)


def test_a_standard_configuration_wins_unless_a_plan_is_clearly_faster() -> None:
    # Six blocks where selective saves almost as much as full and costs a little less: the
    # solver's own mix is a hair faster than every 2nd block, within PREFER_STANDARD.
    prof = _profile(6, chain=False, full_seconds=3.0, selective_seconds=2.97)
    every2 = simulate(prof, ["full", "none"] * 3).peak_bytes + 200
    custom, best_standard = _custom_and_standard(prof, every2)
    assert custom < best_standard <= custom + PREFER_STANDARD * prof.step_seconds
    plan = plan_from_profiles({"fp32": prof}, every2)
    assert list(plan.blocks.values()) == ["full", "none"] * 3 and not plan.segments
    assert "'every2' configuration" in (standard_note(plan, prof) or "")

    # The same budget where selective costs a third of full: memfit's own plan is chosen.
    cheap = _profile(6, chain=False, full_seconds=3.0, selective_seconds=2.3)
    custom, best_standard = _custom_and_standard(cheap, every2)
    assert custom + PREFER_STANDARD * cheap.step_seconds < best_standard
    plan = plan_from_profiles({"fp32": cheap}, every2)
    assert standard_name(cheap, list(plan.blocks.values()), plan.segments) is None
    assert plan.report.predicted_step_seconds <= custom + TIE * cheap.step_seconds  # a tie: the lowest peak
    note = standard_note(plan, cheap) or ""
    assert "fastest PyTorch configuration that fits, 'selective'" in note  # selective fits here too


def test_keeping_everything_is_never_traded_for_a_standard_configuration() -> None:
    prof = _profile(4)
    roomy = simulate(prof, "none").peak_bytes
    assert set(plan_from_profiles({"fp32": prof}, roomy).blocks.values()) == {"none"}


def test_the_sequential_plan_peaks_where_checkpoint_sequential_does() -> None:
    # The configuration memfit plans as "sequential" holds exactly what PyTorch's own
    # checkpoint_sequential holds on the same model and batch (measured, in bytes).
    model = tiny_gpt(n_layer=4)
    opt = torch.optim.AdamW(model.parameters())
    batch = token_batch(8, 16)
    prof = memfit.profile(model, batch, gpt_loss, opt, repeats=1)
    opts = standard_tilings(prof)["sequential"]
    names = [b.name for b in prof.blocks]
    plan = Plan(
        blocks={names[j]: o.mode for o in opts for j in range(o.first, o.last + 1)},
        segments=[names[o.first : o.last + 1] for o in opts if o.segment],
        precision="fp32",
    )
    assert tiling(prof, plan.blocks, plan.segments) == opts
    memfit.apply(model, plan)
    ours = memfit.measure(model, batch, gpt_loss, opt, "fp32", steps=1).peak_bytes
    memfit.uncheckpoint(model)
    with _through_checkpoint_sequential(model, names, sqrt_segments(len(names))):
        theirs = memfit.measure(model, batch, gpt_loss, opt, "fp32", steps=1).peak_bytes
    assert ours == theirs
    install_sequential(model, gpt_loss, batch)  # memfit bench's "sequential": the same segments
    try:
        assert memfit.measure(model, batch, gpt_loss, opt, "fp32", steps=1).peak_bytes == theirs
    finally:
        uninstall_sequential(model)


def _chain(inner: Any, state: tuple[list[Any], int], x: torch.Tensor) -> torch.Tensor:
    functions, segments = state
    return checkpoint_sequential(functions, segments, x, use_reentrant=False)


def _pass_through(inner: Any, x: torch.Tensor) -> torch.Tensor:
    return x


@contextlib.contextmanager
def _through_checkpoint_sequential(model: nn.Module, names: list[str], segments: int) -> Iterator[None]:
    """The model's blocks run by PyTorch's own checkpoint_sequential: the first block runs the
    chain over every block's own forward, the others pass their input through."""
    blocks = [model.get_submodule(n) for n in names]
    functions = [b.forward for b in blocks]
    set_forward_layer(blocks[0], "reference", _chain, (functions, segments))
    for b in blocks[1:]:
        set_forward_layer(b, "reference", _pass_through)
    try:
        yield
    finally:
        for b in blocks:
            set_forward_layer(b, "reference", None)
