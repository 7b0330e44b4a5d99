"""check_stability: healthy models pass, an fp16 overflow fails by name, bad input is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from check_models import drifting_gpt, loud_mlp, mse, vector_batches
from conftest import tiny_gpt, token_batch

from memfit.check.stability import check_stability
from memfit.checkpointing import find_blocks
from memfit.errors import ConfigError, UnsupportedPrecision
from memfit.models.gpt import gpt_loss
from memfit.records import Plan, StabilityReport
from memfit.report.check_report import check_markdown, write_check_report


def _adamw(params):  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(params, lr=1e-3)


def _gpt_batches(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [token_batch(seed=i) for i in range(n)]


@pytest.fixture(scope="module")
def healthy() -> StabilityReport:
    return check_stability(tiny_gpt, _gpt_batches(4), gpt_loss, _adamw, ("bf16", "fp16"), steps=4)


def test_healthy_tiny_gpt_passes_bf16_and_fp16(healthy: StabilityReport) -> None:
    assert healthy.verdict == "PASS", healthy.by_precision
    for p in ("bf16", "fp16"):
        pc = healthy.by_precision[p]
        assert pc.verdict == "PASS" and pc.first_nonfinite is None
        assert len(pc.run.losses) == 4 and all(v is not None for v in pc.run.losses)
        assert pc.band_multiple is not None and pc.band_multiple <= 2
        assert pc.grad_norm_ratio is not None and 0.9 < pc.grad_norm_ratio < 1.1
    fp16 = healthy.by_precision["fp16"]
    assert fp16.modules and {m.module for m in fp16.modules} >= {"blocks.0.attn.qkv", "head"}
    assert all(m.fp16_fraction is not None and m.fp16_fraction < 0.01 for m in fp16.modules)
    assert healthy.noise_band > 0 and healthy.noise.losses != healthy.reference.losses


def test_report_round_trips_and_names_hardware(healthy: StabilityReport, tmp_path: Path) -> None:
    assert StabilityReport.from_json(healthy.to_json()) == healthy
    assert any(line.startswith("fp16") for line in healthy.hardware)
    paths = write_check_report(healthy, tmp_path)
    assert StabilityReport.from_json(paths["json"].read_text()) == healthy
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["md"].read_text()
    assert "# memfit check: PASS" in md and "Hardware facts" in md and "noise band" in md


def test_fp16_overflow_fails_naming_module_and_phase() -> None:
    report = check_stability(loud_mlp, vector_batches(4), mse, _adamw, ("bf16", "fp16"), steps=4)
    fp16 = report.by_precision["fp16"]
    assert report.verdict == "FAIL" and fp16.verdict == "FAIL"
    assert fp16.first_nonfinite is not None
    nf = fp16.first_nonfinite
    assert (nf.module, nf.phase, nf.dtype, nf.step) == ("body.1", "forward", "float16", 1)
    assert any("'body.1'" in r and "forward" in r for r in fp16.reasons)
    assert fp16.skipped_steps == 4
    assert fp16.modules[0].module == "body.1" and fp16.modules[0].fp16_fraction is None  # overflowed
    assert report.by_precision["bf16"].verdict == "PASS"
    assert "`body.1`, forward pass, float16" in check_markdown(report)


def test_checkpointing_plan_is_part_of_what_is_checked() -> None:
    plan = Plan(blocks=dict.fromkeys(find_blocks(tiny_gpt()), "full"))
    report = check_stability(tiny_gpt, _gpt_batches(3), gpt_loss, _adamw, ("bf16",), steps=3, plan=plan)
    assert report.checkpointing == {"blocks.0": "full", "blocks.1": "full"}
    assert report.by_precision["bf16"].verdict == "PASS"


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(UnsupportedPrecision, match="'fp8'"):
        check_stability(tiny_gpt, _gpt_batches(1), gpt_loss, _adamw, ("fp8",), steps=1)
    with pytest.raises(ConfigError, match="list of modes"):
        check_stability(tiny_gpt, _gpt_batches(1), gpt_loss, _adamw, "bf16", steps=1)


@pytest.mark.parametrize("steps", [0, -3])
def test_zero_steps_is_refused(steps: int) -> None:
    with pytest.raises(ConfigError, match="steps must be a positive"):
        check_stability(tiny_gpt, _gpt_batches(1), gpt_loss, _adamw, steps=steps)


def test_model_factory_with_different_weights_is_detected() -> None:
    batches = [(x[:, :8], y[:, :8]) for x, y in _gpt_batches(1)]
    with pytest.raises(ConfigError, match="initial weights differ"):
        check_stability(drifting_gpt, batches, gpt_loss, _adamw, ("bf16",), steps=1)


def test_unseeded_factory_is_seeded_so_its_runs_compare() -> None:
    def unseeded() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))

    report = check_stability(unseeded, vector_batches(3), mse, _adamw, ("bf16",), steps=3)
    assert report.by_precision["bf16"].verdict == "PASS"


def test_skipped_steps_are_compared_with_fp32_skipping_the_same_steps() -> None:
    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))

    def loud_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return mse(model, batch) * 3.0  # scaled gradients overflow fp16 at the first scales

    report = check_stability(mlp, vector_batches(8), loud_loss, _adamw, ("fp16",), steps=8)
    fp16 = report.by_precision["fp16"]
    assert fp16.skipped_steps == 2 and fp16.reference_run is not None
    assert fp16.reference_run.skipped == fp16.run.skipped
    assert fp16.band_multiple is not None and fp16.band_multiple < 2
    assert fp16.verdict == "WARN"  # 25% of steps skipped, above the 20% limit
    assert any("skipped 2 of 8" in r for r in fp16.reasons)
    assert StabilityReport.from_json(report.to_json()) == report
