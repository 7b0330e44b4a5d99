"""torchao's AdamW stepping a large parameter in slices of rows (Note [the step in slices]).

The update is elementwise, so the sliced step gives the whole step's numbers bit for bit;
its fp32 temporaries are one slice's, and the step model predicts them so.
"""

from __future__ import annotations

import copy

import pytest
import torch

from memfit.levers.needs import torchao_available
from memfit.stepmodel import state_bytes

pytestmark = pytest.mark.skipif(not torchao_available(), reason="torchao (memfit[levers]) not installed")

SLICE = 2**14


def _pair(kind: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    from memfit.levers.optim import lever_optimizer

    torch.manual_seed(0)
    a = torch.nn.Embedding(1024, 256)  # 262,144 elements: 16 slices of 16,384
    b = copy.deepcopy(a)
    make = lambda m: lever_optimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), kind, weights_bf16=False)  # noqa: E731
    return a, b, make(a), make(b)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, grad: torch.Tensor, size: int) -> int:
    """One step with slices of ``size`` elements; MemTracker's peak above what was held before."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from memfit.checkpointing.compile import eager

    model.weight.grad = grad.clone()
    old, state_bytes.STEP_SLICE_ELEMENTS = state_bytes.STEP_SLICE_ELEMENTS, size
    old_eager, state_bytes.EAGER_STEP_SLICE_ELEMENTS = state_bytes.EAGER_STEP_SLICE_ELEMENTS, size
    tracker = MemTracker()
    tracker.track_external(model, opt)
    try:
        with eager(), tracker:
            before = sum(v["Total"] for v in tracker.get_tracker_snapshot("current").values())
            opt.step()
        peak = sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    finally:
        state_bytes.STEP_SLICE_ELEMENTS = old
        state_bytes.EAGER_STEP_SLICE_ELEMENTS = old_eager
    return peak - before


@pytest.mark.parametrize("kind", ["4bit", "8bit", "bf16", "fp32"])
def test_sliced_step_equals_the_whole_step_with_one_slice_of_temporaries(kind: str) -> None:
    whole, sliced, opt_w, opt_s = _pair(kind)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grad = torch.randn(1024, 256, generator=g)
        peak_whole = _step(whole, opt_w, grad, 2**30)
        peak_sliced = _step(sliced, opt_s, grad, SLICE)
    assert torch.equal(whole.weight, sliced.weight)
    for key in ("exp_avg", "exp_avg_sq"):
        a, b = opt_w.state[whole.weight][key], opt_s.state[sliced.weight][key]
        plain = [t.dequantize() if hasattr(t, "dequantize") else t for t in (a, b)]  # quantized moments
        assert torch.equal(*plain), key
    # the whole step's temporaries scale with 262,144 elements, the sliced one's with 16,384
    assert peak_sliced * 8 < peak_whole, (peak_sliced, peak_whole)


def test_step_model_predicts_one_slice_of_temporaries() -> None:
    size = state_bytes.STEP_SLICE_ELEMENTS
    assert state_bytes.step_slice_numel(10 * size, "4bit") == size
    assert state_bytes.step_slice_numel(10 * size, "orig") == 10 * size
    assert state_bytes.step_slice_numel(100, "8bit") == 100
    eager = state_bytes.EAGER_STEP_SLICE_ELEMENTS
    assert eager < size
    assert state_bytes.step_slice_numel(10 * size, "4bit", eager=True) == eager
    assert state_bytes.step_slice_numel(10 * size, "orig", eager=True) == 10 * size


def test_the_step_knows_how_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager under memfit's measuring stance or with dynamo disabled; compiled otherwise
    (Note [pricing the step that runs])."""
    from memfit.levers.optim import step_runs_eagerly

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    if torch._dynamo.config.disable:
        pytest.skip("TORCH_COMPILE_DISABLE=1: the step always runs eagerly here")
    assert not step_runs_eagerly()
    with torch.compiler.set_stance("force_eager"):
        assert step_runs_eagerly()
        assert not step_runs_eagerly(training=True)  # training runs outside memfit's stance
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert step_runs_eagerly(training=True)
