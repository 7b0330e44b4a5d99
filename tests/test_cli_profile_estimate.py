"""``memfit profile`` and ``memfit estimate``: tables, JSON, verdict line, exit code 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.cli.main import main
from memfit.records import Estimate, Profile

TINY = [
    "--set",
    "model.n_layer=3",
    "--set",
    "model.n_embd=16",
    "--set",
    "model.n_head=2",
    "--set",
    "model.block_size=8",
    "--set",
    "train.batch_size=2",
]


def test_estimate_table_and_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *TINY, "--precision", "fp32", "--device-memory", "10MiB"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    header = next(line for line in out if line.startswith("strategy"))
    for column in ("parameters", "gradients", "optimizer", "activations", "temporaries", "peak", "fits?"):
        assert column in header
    rows = [line for line in out if line.startswith("fp32 / ")]
    assert [r.split()[2] for r in rows] == ["none", "selective", "full"]
    assert out[-1].startswith("fits in 10.00 MiB: fp32 with no checkpointing")


def test_estimate_json_and_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *TINY, "--precision", "bf16", "--json"]) == 0
    est = Estimate.from_json(capsys.readouterr().out)
    smallest = min(e.peak_bytes for e in est.entries)
    assert {e.mode for e in est.entries} == {"none", "selective", "full"}
    assert main(["estimate", *TINY, "--precision", "bf16", "--device-memory", str(smallest - 1000)]) == 0
    verdict, levers = capsys.readouterr().out.strip().splitlines()[-2:]
    assert verdict.startswith("without levers, nothing fits in") and "1000 B more" in verdict
    assert levers.startswith("smallest plan with levers") and levers.endswith(
        "(memfit estimate --levers all)"
    ), levers


@pytest.mark.parametrize("value", ["--device-memory=-3GiB", "--device-memory=lots", "--device-memory=0"])
@pytest.mark.parametrize("command", ["estimate", "profile"])
def test_bad_device_memory_exits_2(command: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, *TINY, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"memfit {command}: error: ") and "device memory" in err[0]


@pytest.mark.parametrize("command", ["estimate", "profile"])
def test_batch_that_does_not_fit_exits_2(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--set", "model.name=import:conftest:mismatched_spec"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "on the batch (tensors of shapes (8, 7), (8, 1)) failed" in err[0]


def test_profile_json_out_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "profile.json"
    argv = ["profile", *TINY, "--repeats", "1", "--precision", "fp32", "--out", str(out_file)]
    assert main([*argv, "--device-memory", "1GiB"]) == 0
    text = capsys.readouterr().out
    assert "blocks.2" in text and "kept full" in text
    assert text.strip().splitlines()[-1].startswith("fits in 1.00 GiB: fp32 with no checkpointing")
    prof = Profile.from_json(out_file.read_text())
    assert [b.name for b in prof.blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert prof.batch_size == 2


def test_profile_of_a_model_without_blocks_warns(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.warns(UserWarning, match="no repeated blocks"):
        code = main(
            ["profile", "--set", "model.name=import:conftest:blockless_spec", "--repeats", "1", "--json"]
        )
    assert code == 0
    prof = Profile.from_dict(json.loads(capsys.readouterr().out))
    assert prof.blocks == [] and prof.outside.saved_bytes["none"] > 0


def test_verdict_names_what_does_not_fit() -> None:
    from memfit.records import EstimateEntry
    from memfit.report.memory_tables import verdict_line

    parts = {"params": 40, "grads": 40, "optimizer": 80, "activations": 30, "temporaries": 10}
    big = EstimateEntry("bf16", "full", 200, parts)
    assert "optimizer state alone take 160 B" in verdict_line([big], 100)
    assert verdict_line([big], 180).endswith("20 B more; use a smaller batch or shorter sequences.")
    assert verdict_line([big], 200).startswith("fits in 200 B: bf16 with full checkpointing")
