"""A lever is one object and one registry line: a toy lever defined here, registered, that the
planner chooses only when the budget needs it, predicts, measures and applies like its own.

The toy replaces the optimizer by plain SGD, which keeps no state: it shrinks what the
profile measured as the optimizer's state (AdamW's two moments) to nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from conftest import tiny_gpt, token_batch

import memfit
from memfit.applying import Lever, Site, normalize_levers, register, unregister
from memfit.applying.lever import Applying, Predicting
from memfit.errors import InfeasibleBudget
from memfit.models.gpt import gpt_loss
from memfit.planning.choose import plan_from_profiles
from memfit.records import Plan, Profile


class ToySgd(Lever):
    """The optimizer replaced by plain SGD (no state)."""

    name = "toy_sgd"
    risk = 3
    order = 25
    needs_optimizer = True

    def refusal(self, site: Site) -> str | None:
        return "toy_sgd replaces the optimizer; pass one." if site.optimizer == "none" else None

    def predict(self, out: Profile, ctx: Predicting) -> None:
        out.optimizer_bytes, out.optimizer_temp_bytes, out.optimizer_bytes_by_dtype = 0, 0, {}
        out.optimizer = "SGD"

    def apply(self, optimizer: torch.optim.Optimizer | None, ctx: Applying) -> torch.optim.Optimizer | None:
        assert optimizer is not None
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return torch.optim.SGD(params, lr=optimizer.param_groups[0]["lr"])


@pytest.fixture
def toy() -> Iterator[ToySgd]:
    lever = register(ToySgd())
    try:
        yield lever
    finally:
        unregister(lever.name)


def test_the_planner_chooses_a_registered_lever_only_when_the_budget_needs_it(toy: ToySgd) -> None:
    assert "toy_sgd" in normalize_levers("all")
    model, batch = tiny_gpt(), token_batch(4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    profiles: dict[str, Profile] = {}
    roomy = memfit.plan(model, batch, gpt_loss, "90%", opt, "fp32", profiles=profiles, levers=["toy_sgd"])
    assert roomy.levers == []  # a plan without it fits: not used
    with pytest.raises(InfeasibleBudget) as info:
        plan_from_profiles(profiles, 1)
    smallest = info.value.minimum_bytes  # the smallest step without the lever
    budget = smallest - 1
    tight = memfit.plan(model, batch, gpt_loss, budget, opt, precision="fp32", levers=["toy_sgd"])
    assert tight.levers == ["toy_sgd"]
    assert tight.predicted_peak_bytes <= budget and 0 < tight.measured_peak_bytes <= budget
    assert tight.report.lever_savings["toy_sgd"] > 0
    # a plan names it, reads back, and memfit.prepare applies it with the rest of the decision
    assert Plan.from_json(tight.to_json()) == tight
    _, trained_with = memfit.prepare(model, opt, tight)
    assert type(trained_with) is torch.optim.SGD
    memfit.train_step(model, batch, gpt_loss, trained_with, tight)


def test_an_unregistered_lever_is_refused_in_one_sentence(toy: ToySgd) -> None:
    unregister(toy.name)
    with pytest.raises(memfit.MemfitError, match="unknown lever 'toy_sgd'"):
        memfit.apply(tiny_gpt(), Plan(blocks={}, levers=["toy_sgd"]))
    register(toy)
