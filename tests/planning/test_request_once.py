"""What a plan call asks for is resolved once: the budget parsed once and refused at most once,
a plan checked once between ``memfit.prepare`` and the first step, and the user's own blocks
reaching the planner and the profiler."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_gpt, token_batch

import memfit
from memfit.budget import Budget
from memfit.cli.main import main
from memfit.errors import ConfigError
from memfit.models.gpt import gpt_loss
from memfit.records import Plan

TINY = [
    "--set", "model.n_layer=2", "--set", "model.n_embd=16", "--set", "model.n_head=2",
    "--set", "model.block_size=16", "--set", "train.batch_size=4",
]  # fmt: skip


def _counting(
    monkeypatch: pytest.MonkeyPatch, where: Any, name: str, counted: Callable[..., bool]
) -> list[int]:
    """Count the calls of ``where.name`` for which ``counted(*args)`` holds."""
    calls: list[int] = []
    original = getattr(where, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if counted(*args, **kwargs):
            calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(where, name, wrapper)
    return calls


def _parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of ``Budget.parse`` that read a budget (one already parsed is handed back as it is)."""
    calls: list[int] = []
    original = Budget.parse.__func__  # type: ignore[attr-defined]

    def parse(cls: type[Budget], value: Any, what: str = "budget") -> Budget:
        if not isinstance(value, Budget):
            calls.append(1)
        result: Budget = original(cls, value, what)
        return result

    monkeypatch.setattr(Budget, "parse", classmethod(parse))
    return calls


def test_memfit_plan_parses_the_budget_once_and_refuses_it_at_most_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from memfit.planning import request

    parses = _parses(monkeypatch)
    refusals = _counting(monkeypatch, request, "refuse_over_room", lambda *a, **k: True)
    resolutions = _counting(monkeypatch, request.Request, "budget_bytes", lambda *a, **k: True)
    assert main(["plan", *TINY, "--budget", "60%", "--out", str(tmp_path / "p.json")]) == 0
    assert len(parses) == 1  # the command line's check parses it; the planner gets the Budget
    assert len(refusals) <= 1 and len(resolutions) == 1
    # a byte budget: refused once, before anything is measured
    parses.clear()
    refusals.clear()
    assert main(["plan", *TINY, "--budget", "1000TiB", "--out", str(tmp_path / "q.json")]) == 2
    assert "more than cpu has room for" in capsys.readouterr().err
    assert len(parses) == 1 and len(refusals) == 1


def test_a_plan_is_checked_once_between_prepare_and_the_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from memfit.applying import apply_plan

    model, batch = tiny_gpt(), token_batch(4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = memfit.plan(model, batch, gpt_loss, "90%", opt, precision="fp32")
    checks = _counting(monkeypatch, apply_plan, "check_plan_fits", lambda *a, **k: True)
    model, opt = memfit.prepare(model, opt, plan)
    memfit.train_step(model, batch, gpt_loss, opt, plan)
    memfit.train_step(model, batch, gpt_loss, opt, plan)
    assert len(checks) == 1
    checks.clear()
    fresh = tiny_gpt()
    trainer = memfit.Trainer(
        fresh, torch.optim.AdamW(fresh.parameters()), gpt_loss, plan=plan, progress=False
    )
    trainer.step(batch)
    assert len(checks) == 1


def test_the_users_own_blocks_reach_the_planner_and_the_profiler(capsys: pytest.CaptureFixture[str]) -> None:
    model, batch = tiny_gpt(n_layer=3), token_batch(4)
    assert memfit.find_blocks(model) == ["blocks.0", "blocks.1", "blocks.2"]
    mine = ["blocks.0", "blocks.2"]
    profile = memfit.profile(model, batch, gpt_loss, repeats=1, blocks=mine)
    assert [b.name for b in profile.blocks] == mine
    plan = memfit.plan(model, batch, gpt_loss, "70%", precision="fp32", blocks=mine)
    assert set(plan.blocks) == set(mine) and plan.measured_peak_bytes <= plan.budget_bytes
    memfit.prepare(model, torch.optim.AdamW(model.parameters()), plan)  # made for this model: applies
    with pytest.raises(ConfigError, match=r"no module named .blocks\.9."):
        memfit.plan(model, batch, gpt_loss, "70%", precision="fp32", blocks=["blocks.9"])


def test_the_command_line_takes_blocks(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", *TINY, "--budget", "85%", "--blocks", "blocks.1", "--out", str(out)]) == 0
    assert set(Plan.from_json(out.read_text()).blocks) == {"blocks.1"}
