"""The ``tiled_mlp`` lever (memfit.applying.tiled_mlp): one object and one registry line. The
planner chooses it, and its chunk count, only where no plan without it fits; its predicted
peak is the measured one; ``memfit.apply`` applies it and ``applied`` undoes it; a plan that
names it trains exactly as the plain step; bad settings and models without MLPs are refused in
one sentence.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memfit
from memfit.applying import applied, lever, normalize_levers, with_levers
from memfit.applying.lever import Site
from memfit.applying.tiled_mlp import TILED_MLP
from memfit.errors import ConfigError, InfeasibleBudget
from memfit.levers.tiled_mlp import tiled_mlps
from memfit.models.llama import llama
from memfit.planning.choose import plan_from_profiles
from memfit.records import Plan, Profile

#: A matmul of fewer rows may take another kernel (a last-bit difference per position) and a
#: weight's gradient is a sum over chunks in another order (a few ulps; gradients ~1e-3).
FP32 = {"rtol": 1e-5, "atol": 1e-6}

Batch = tuple[torch.Tensor, torch.Tensor]


def _llama(positions: int = 512) -> tuple[nn.Module, Batch, torch.optim.Optimizer]:
    torch.manual_seed(0)
    spec = llama(preset="tiny", block_size=positions)
    x, y = spec.random_batch(1, seed=0)
    return spec.model, (x, y), torch.optim.AdamW(spec.model.parameters(), lr=1e-3)


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    out: torch.Tensor = model(x, y)
    return out


def _smallest_without(model: nn.Module, batch: Batch, opt: torch.optim.Optimizer) -> int:
    profiles: dict[str, Profile] = {}
    memfit.plan(model, batch, _loss, "90%", opt, "fp32", profiles=profiles, check=False)
    with pytest.raises(InfeasibleBudget) as info:
        plan_from_profiles(profiles, 1)
    return info.value.minimum_bytes


def test_registered_and_in_all() -> None:
    assert "tiled_mlp" in normalize_levers("all")
    assert lever("tiled_mlp").risk == 0 and lever("tiled_mlp").step_facts


def test_chosen_only_when_nothing_without_it_fits_and_predicted_to_the_byte() -> None:
    model, batch, opt = _llama()
    roomy = memfit.plan(model, batch, _loss, "90%", opt, "fp32", levers=["tiled_mlp"])
    assert roomy.levers == []  # a plan without it fits: not used
    budget = _smallest_without(model, batch, opt) - 1
    tight = memfit.plan(model, batch, _loss, budget, opt, "fp32", levers=["tiled_mlp"])
    assert tight.levers == ["tiled_mlp"]
    chunks = tight.setting("tiled_mlp", "chunks")
    assert chunks in (2, 4, 8, 16, 32, 64)
    assert tight.predicted_peak_bytes <= budget
    assert tight.measured_peak_bytes == tight.predicted_peak_bytes  # the step model, to the byte
    assert tight.report.lever_savings["tiled_mlp"] > 0
    assert any(
        n.startswith(f"tiled_mlp: 2 MLPs (512 positions x 1 rows) in {chunks} chunks") for n in tight.notes
    )
    assert Plan.from_json(tight.to_json()) == tight
    assert tiled_mlps(model) == {}  # planning measured it inside applied: undone


def _least_at(profiles: dict[str, Profile], chunks: int) -> int:
    moved = {
        p: with_levers(TILED_MLP.at_settings(prof, {"chunks": chunks}), ["tiled_mlp"])
        for p, prof in profiles.items()
    }
    with pytest.raises(InfeasibleBudget) as info:
        plan_from_profiles(moved, 1)
    return info.value.minimum_bytes


def test_the_fewest_chunks_that_fit() -> None:
    model, batch, opt = _llama()
    profiles: dict[str, Profile] = {}
    memfit.plan(model, batch, _loss, "90%", opt, "fp32", profiles=profiles, levers=["tiled_mlp"], check=False)
    least = {n: _least_at(profiles, n) for n in (2, 4, 8)}
    assert least[2] > least[4] >= least[8]  # more chunks, fewer bytes
    tight = memfit.plan(model, batch, _loss, least[4], opt, "fp32", levers=["tiled_mlp"], check=False)
    assert tight.levers == ["tiled_mlp"] and tight.setting("tiled_mlp", "chunks") == 4
    assert tight.predicted_peak_bytes == least[4]


def test_applied_undone_and_apply_exact() -> None:
    model, batch, opt = _llama(256)
    plain = copy.deepcopy(model)
    plan = Plan(blocks={}, levers=["tiled_mlp"], lever_settings={"tiled_mlp": {"chunks": 4}})
    with applied(model, plan, opt):
        assert tiled_mlps(model) == {"blocks.0.mlp": 4, "blocks.1.mlp": 4}
    assert tiled_mlps(model) == {}
    done = memfit.apply(model, plan, opt)
    assert tiled_mlps(model) == {"blocks.0.mlp": 4, "blocks.1.mlp": 4}
    loss, ref = _loss(done.model, batch), _loss(plain, batch)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref, **FP32)
    for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, **FP32)
    memfit.apply(model, Plan(blocks={}), opt)  # a later plan without it takes it off
    assert tiled_mlps(model) == {}


@pytest.mark.parametrize("settings", [{"chunks": -1}, {"chunks": "8"}, {"chunk": 8}, {"chunks": True}])
def test_bad_settings_one_sentence(settings: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=r"^the tiled_mlp lever's settings are .*got .*\.$"):
        lever("tiled_mlp").check_settings(settings)  # type: ignore[arg-type]


def test_a_model_without_mlps_is_refused_with_the_reason() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    why = lever("tiled_mlp").refusal(Site(torch.device("cpu"), "AdamW", "fp32", model))
    assert why is not None and why.endswith(".") and "\n" not in why
    x = torch.randn(64, 8)
    plan = memfit.plan(model, (x, x), lambda m, b: (m(b[0]) - b[1]).pow(2).mean(), 2**30, levers="all")
    assert "tiled_mlp" not in plan.levers
    assert any(n.startswith("lever tiled_mlp not used:") for n in plan.notes)
