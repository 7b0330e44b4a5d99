"""``memfit.plan(..., maximize="batch_size")`` and ``memfit plan --maximize batch_size``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import memfit
from memfit.cli.main import main
from memfit.errors import ConfigError
from memfit.measuring.memory import measure
from memfit.measuring.profile import profile
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.planning.largest_batch import resize_batch
from memfit.planning.solver import minimum_peak, solve
from memfit.records import Plan

MIB = 1 << 20


@pytest.mark.slow
def test_largest_batch_of_the_built_in_gpt_at_64_mib() -> None:
    """The returned batch measures under 64 MiB; one more sample does not fit by the planner's prediction."""
    torch.manual_seed(0)
    model = GPT(GPTConfig())  # the built-in GPT as memfit train builds it by default
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (8, 128))
    plan = memfit.plan(model, (x, x), gpt_loss, 64 * MIB, opt, precision="fp32", maximize="batch_size")
    n = plan.batch_size
    assert n > 8 and plan.micro_batches == 1 and plan.budget_bytes == 64 * MIB
    bigger = resize_batch((x, x), n)
    assert bigger[0].shape == (n, 128)
    memfit.apply(model, plan)
    measured = measure(model, bigger, gpt_loss, opt, "fp32", steps=1).peak_bytes
    assert measured <= 64 * MIB, (n, measured)
    memfit.uncheckpoint(model)
    one_more = profile(model, resize_batch((x, x), n + 1), gpt_loss, opt, "fp32", repeats=1)
    assert solve(one_more, 64 * MIB, 1) is None
    assert minimum_peak(one_more, 1).peak_bytes > 64 * MIB
    assert any(f"a batch of {n + 1} needs at least" in note for note in plan.notes), plan.notes


def test_resize_batch_keeps_every_other_dimension() -> None:
    x = torch.arange(12).reshape(3, 4)
    y = torch.arange(3)
    big = resize_batch((x, y), 5)
    assert big[0].shape == (5, 4) and big[1].tolist() == [0, 1, 2, 0, 1]
    assert resize_batch(x, 2).tolist() == x[:2].tolist()


def test_unknown_maximize_and_nothing_fits_are_one_sentence() -> None:
    model = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8))
    x = torch.randint(0, 256, (2, 8))
    with pytest.raises(ConfigError, match="maximize='speed' is not one of batch_size"):
        memfit.plan(model, (x, x), gpt_loss, "1MiB", maximize="speed")
    with pytest.raises(memfit.InfeasibleBudget, match="not even a batch of one fits"):
        memfit.plan(model, (x, x), gpt_loss, 1000, precision="fp32", maximize="batch_size")


def test_plan_cli_maximize_batch_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ["--set", "model.n_layer=2", "--set", "model.n_embd=16", "--set", "model.n_head=2",
            "--set", "model.block_size=16", "--set", "train.batch_size=2"]  # fmt: skip
    out = tmp_path / "plan.json"
    assert main(["plan", *tiny, "--maximize", "batch_size", "--budget", "1MiB", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    plan = Plan.from_json(out.read_text())
    assert plan.batch_size > 2 and plan.micro_batches == 1
    assert f"batch size     {plan.batch_size} (the largest that fits" in text
    assert 0 < plan.measured_peak_bytes <= plan.budget_bytes == MIB
    assert main(["plan", *tiny, "--maximize", "batch_size", "--budget", "1KiB", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not even a batch of one fits" in err and "Traceback" not in err


def test_plan_records_its_batch_and_older_plans_still_load() -> None:
    model = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8))
    x = torch.randint(0, 256, (3, 8))
    plan = memfit.plan(model, (x, x), gpt_loss, "90%", precision="fp32", check=False)
    assert plan.batch_size == 3 and Plan.from_json(plan.to_json()).batch_size == 3
    old = plan.to_dict()
    del old["batch_size"]
    assert Plan.from_dict(old).batch_size == 0
