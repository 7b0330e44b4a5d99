"""``memfit plan`` and ``memfit bench --plan`` end to end on a tiny built-in GPT."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from memfit.cli.main import main
from memfit.records import BenchPoint, Plan

TINY = [
    "--set", "model.n_layer=2", "--set", "model.n_embd=16", "--set", "model.n_head=2",
    "--set", "model.block_size=16", "--set", "train.batch_size=4",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_plan_cli_prints_the_plan_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", *TINY, "--budget", "85%", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    plan = Plan.from_json(out.read_text())
    assert set(plan.blocks) == {"blocks.0", "blocks.1"}
    in_segment = {n for seg in plan.segments for n in seg}
    for name, mode in plan.blocks.items():
        assert f"{name}  {'segment' if name in in_segment else mode}" in text
    assert "of the baseline" in text and "predicted" in text and f"plan written to {out}" in text
    assert 0 < plan.measured_peak_bytes <= plan.budget_bytes == int(0.85 * plan.report.baseline_peak_bytes)


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        ("abc", "cannot read --budget 'abc'"),  # the flag, as written (checked before torch is imported)
        ("-1GB", "budget must be positive"),
        ("150%", "over 100%"),
        ("0", "budget must be positive"),
        ("1KB", "AdamW state alone take"),
    ],
)
def test_plan_cli_refuses_bad_budgets(
    budget: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", *TINY, f"--budget={budget}", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_bench_includes_planner_points(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "b"
    argv = ["bench", *TINY, "--strategies", "fp32/none,fp32/full", "--plan", "80%", "--steps", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    points = {p.strategy: p for p in (BenchPoint.from_dict(d) for d in data["points"])}
    assert set(points) == {"fp32/none", "fp32/full", "plan@80%"}
    assert points["plan@80%"].ok and points["plan@80%"].checkpointing == "plan"
    assert points["plan@80%"].peak_bytes <= int(0.8 * points["fp32/none"].peak_bytes)
    assert "plan@80%" in capsys.readouterr().out
