"""``memfit estimate --device-memory``: when nothing fits, the last lines say what would (issue 37)."""

from __future__ import annotations

import pytest

from memfit.cli.main import main

pytest.importorskip("torchao", reason="the state levers need torchao (memfit[levers])")

#: A step whose parameters, gradients and AdamW state (27 MiB) are nearly all of it.
WIDE = ["--set", "model.n_layer=2", "--set", "model.n_embd=256", "--set", "model.n_head=4"]
WIDE += [
    "--set",
    "model.block_size=8",
    "--set",
    "train.batch_size=1",
    "--precision",
    "fp32",
    "--precision",
    "bf16",
]


def _last_lines(capsys: pytest.CaptureFixture[str], memory: str) -> list[str]:
    assert main(["estimate", *WIDE, "--device-memory", memory]) == 0
    return capsys.readouterr().out.strip().splitlines()[-2:]


def test_nothing_fits_says_what_the_levers_would_fit(capsys: pytest.CaptureFixture[str]) -> None:
    verdict, levers = _last_lines(capsys, "20MiB")
    assert verdict.startswith("without levers, nothing fits in 20.00 MiB: the smallest strategy"), verdict
    assert levers.startswith("smallest plan with levers "), levers
    assert levers.endswith("; fits 20.00 MiB (memfit estimate --levers all)"), levers


def test_a_strategy_that_fits_needs_no_lever_line(capsys: pytest.CaptureFixture[str]) -> None:
    verdict = _last_lines(capsys, "1GiB")[-1]
    assert verdict.startswith("fits in 1.00 GiB: "), verdict
