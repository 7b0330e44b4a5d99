"""``memfit check``: writes check.md/json/png, exits 1 on FAIL and 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.cli.main import main

TINY = [
    "--set",
    "model.n_layer=1",
    "--set",
    "model.n_embd=16",
    "--set",
    "model.n_head=2",
    "--set",
    "model.block_size=8",
    "--set",
    "train.batch_size=2",
    "--set",
    "train.eval_batches=1",
    "--set",
    "data.max_bytes=200000",
]


def test_check_writes_its_three_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", *TINY, "--steps", "3", "--precisions", "bf16", "--out", str(tmp_path), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "bf16: PASS" in out
    data = json.loads((tmp_path / "check.json").read_text())
    assert data["by_precision"]["bf16"]["verdict"] == "PASS" and data["steps"] == 3
    assert (tmp_path / "check.png").stat().st_size > 10_000
    assert "bf16" in (tmp_path / "check.md").read_text()


def test_overflowing_model_fails_with_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["check", "--set", "model.name=import:check_models:loud_spec", "--set", "train.batch_size=4"]
    code = main([*args, "--steps", "3", "--precisions", "fp16", "--out", str(tmp_path), "--quiet"])
    out = capsys.readouterr().out
    assert code == 1
    assert "fp16: FAIL" in out and "'body.1'" in out and "forward" in out


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--precisions", "fp8"], "unknown precision 'fp8'"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--set", "model.name=import:check_models:drifting_gpt"], "initial weights differ"),
        (["--set", "memory.checkpointing=auto", "--set", "memory.budget=1GiB"], "memfit plan"),
        (["--plan", "no/such/plan.json"], "does not exist"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    extra: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["check", *TINY, "--steps", "1", "--out", str(tmp_path), "--quiet", *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert words in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
