"""``memfit estimate --levers``: the smallest plan with levers for LLaMA 7B and 1.3B (fake tensors)."""

from __future__ import annotations

import re

import pytest

from memfit.cli.main import main

pytest.importorskip("torchao")

LLAMA = ["--set", "model.name=import:memfit.models.llama:llama", "--set", "train.batch_size=1"]
LLAMA += ["--set", "model.kwargs.block_size=2048", "--precision", "bf16", "--levers", "all"]


def _lever_line(capsys: pytest.CaptureFixture[str], preset: str) -> re.Match[str]:
    assert (
        main(["estimate", *LLAMA, "--set", f"model.kwargs.preset={preset}", "--device-memory", "12GiB"]) == 0
    )
    out = capsys.readouterr().out
    found = re.search(
        r"smallest plan with levers ([a-z_0-9, ]+): bf16, full checkpointing, peak ([0-9.]+) GiB "
        r"\(([0-9.]+) bytes per parameter; model state ([0-9.]+)\); (fits|does not fit) 12.00 GiB",
        out,
    )
    assert found is not None, out
    return found


def test_estimate_prints_the_7b_plan_with_levers_and_its_peak(capsys: pytest.CaptureFixture[str]) -> None:
    found = _lever_line(capsys, "7b")
    # the optimizer step's temporaries are one slice's (Note [the step in slices]), so the
    # smallest plan peaks in the forward and needs no fused step
    assert "state_4bit" in found[1] and "weights_bf16" in found[1]
    # NOTE: without levers, parameters + gradients + AdamW state alone are 16 bytes per parameter
    assert float(found[4]) < 4 and 20 < float(found[2]) < 60


def test_estimate_fits_the_1_3b_plan_with_levers_in_12_gib(capsys: pytest.CaptureFixture[str]) -> None:
    found = _lever_line(capsys, "1.3b")
    assert found[5] == "fits" and float(found[2]) <= 12
