"""PASS, WARN and FAIL on constructed cases: each threshold, on each side."""

from __future__ import annotations

import dataclasses

import pytest

from memfit.check.verdict import Thresholds, judge, worst
from memfit.records import ModuleRange, NonFinite, PrecisionCheck, RunCurve


def _case(**changes: object) -> PrecisionCheck:
    run = RunCurve("fp16", "fp16", losses=[1.0] * 20, skipped=[False] * 20, eval_loss=1.0)
    base = PrecisionCheck(
        "fp16", "", [], run, loss_delta=0.001, band_multiple=0.5, grad_norm_ratio=1.0, final_scale=65536.0
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_healthy_numbers_pass_with_reasons() -> None:
    verdict, reasons = judge(_case())
    assert verdict == "PASS"
    assert any("noise bands" in r for r in reasons)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"band_multiple": 3.0}, "3.00 noise bands"),
        ({"grad_norm_ratio": 1.4}, "gradient-norm ratio"),
        ({"grad_norm_ratio": 0.7}, "gradient-norm ratio"),
        ({"skipped_steps": 5}, "skipped 5 of 20"),
        ({"modules": [ModuleRange("blocks.0.mlp", "float16", 40000.0, 40000 / 65504)]}, "'blocks.0.mlp'"),
        ({"modules": [ModuleRange("head", "float16", 3.0, 3 / 65504, 0.2)]}, "underflow"),
    ],
)
def test_warn_cases(changes: dict[str, object], words: str) -> None:
    verdict, reasons = judge(_case(**changes))
    assert verdict == "WARN"
    assert any(words in r for r in reasons), reasons


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"band_multiple": 6.0}, "6.00 noise bands"),
        ({"skipped_steps": 11}, "skipped 11 of 20"),
        ({"final_scale": 0.5}, "fell to 0.5"),
        ({"first_nonfinite": NonFinite("body.1", "forward", "float16", "inf", 3)}, "module 'body.1'"),
    ],
)
def test_fail_cases(changes: dict[str, object], words: str) -> None:
    verdict, reasons = judge(_case(**changes))
    assert verdict == "FAIL"
    assert any(words in r for r in reasons), reasons


def test_boundaries_are_inclusive_for_pass() -> None:
    t = Thresholds()
    assert judge(_case(band_multiple=t.warn_band), t)[0] == "PASS"
    assert judge(_case(band_multiple=t.fail_band), t)[0] == "WARN"
    assert judge(_case(skipped_steps=4), t)[0] == "PASS"  # 20% of 20 steps


def test_non_finite_final_weights_fail() -> None:
    case = _case()
    case.run.eval_loss = None
    assert judge(case)[0] == "FAIL"


def test_custom_thresholds_and_worst() -> None:
    assert judge(_case(band_multiple=1.5), Thresholds(warn_band=1.0, fail_band=3.0))[0] == "WARN"
    assert worst(["PASS", "WARN"]) == "WARN"
    assert worst(["WARN", "FAIL", "PASS"]) == "FAIL"
    assert worst([]) == "PASS"
    with pytest.raises(ValueError, match="warn_band"):
        Thresholds(warn_band=5.0, fail_band=2.0)
