"""The adapter step's table of ``memfit estimate`` (report.adapter_table), and what the CLI says
without what adapters need. The table on real models: tests/integrations/test_peft_estimate.py."""

from __future__ import annotations

import importlib.util

import pytest

from memfit.app.config import load_config
from memfit.cli.estimate import adapter_lines
from memfit.cli.main import main
from memfit.records import Estimate, EstimateEntry
from memfit.report.adapter_table import ADAPTER_ROWS, adapter_table


def _entry(params: int, temporaries: int) -> EstimateEntry:
    parts = {"params": params, "grads": 0, "optimizer": 80, "activations": 200, "temporaries": temporaries}
    return EstimateEntry("bf16", "full", sum(parts.values()), parts)


def test_every_part_has_its_row_and_the_frozen_base_is_the_parameters_less_the_adapters() -> None:
    columns = [("fp32 base", _entry(4040, 100)), ("nf4 base", _entry(640, 300))]
    lines = adapter_table(columns, adapter_bytes=40, device_memory=1500).splitlines()
    assert lines[0].split()[-4:] == ["fp32", "base", "nf4", "base"]
    names = [line.split("  ")[0] for line in lines[2:]]
    assert names == ["checkpointing", *ADAPTER_ROWS, "fits?"]
    rows = {line.split("  ")[0]: line.split()[-4:] for line in lines[2:]}
    assert rows["frozen base (with buffers)"] == ["3.91", "KiB", "600", "B"]  # 4000 B and 600 B
    assert rows["adapter weights"] == ["40", "B", "40", "B"]
    assert lines[-1].split()[-2:] == ["no", "yes"]  # peaks 4420 B and 1220 B against 1500 B


def test_without_a_bf16_profile_the_adapter_step_says_what_to_add() -> None:
    cfg = load_config(None, ["model.name='hf:llama'", "model.lora.rank=4"])
    est = Estimate(model="m", param_count=10, batch_size=1, device="cpu", optimizer="AdamW", entries=[])
    assert adapter_lines(est, cfg, chunked=False, memory=None) == [
        "adapter step: estimated at bf16, where the bf16 and NF4 bases compute; add --precision bf16."
    ]


@pytest.mark.skipif(importlib.util.find_spec("peft") is not None, reason="peft is installed here")
def test_adapters_without_peft_are_one_sentence_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    settings = ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=8"]
    settings += ["model.lora.rank=4", "model.lora.target_modules=['qkv']"]
    assert main(["estimate", *(a for s in settings for a in ("--set", s))]) == 2
    err = capsys.readouterr().err
    assert "pip install 'memfit[peft]'" in err and len(err.strip().splitlines()) == 1, err
