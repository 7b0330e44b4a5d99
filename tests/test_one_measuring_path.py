"""One measuring path (issue 36): the planner measures memory on the fake twin, room or not.

The planner's profile (``Profiler.twin_memory``) must hold the bytes real tracked steps
measure (``memfit.profile``), mode by mode and block by block, and a plan made where the
plain step fits runs no real tracked step but the chosen plan's check. See Note [one
measuring path] in memfit/measuring/twin.py; the third-party zoo's side is
tests/integrations/test_zoo_twin_memory.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import (
    DropoutMLP,
    SmallCNN,
    cnn_loss,
    image_batch,
    mse_loss,
    tiny_gpt,
    token_batch,
    vector_batch,
)
from torch import nn

import memfit
from memfit.measuring.preserve import preserved
from memfit.measuring.profile import Profiler
from memfit.models.gpt import gpt_loss
from memfit.precision import Precision
from memfit.records import Profile
from memfit.stepmodel import simulate

#: Bytes a real CPU kernel may hold past what its fake-tensor twin counts: a reduction can
#: leave its scalar result in a buffer of the batch's rows (mse_loss's mean over 8 rows keeps
#: 32 bytes for a 4-byte loss; a bf16 cross-entropy 96 more), held to the step's end.
KERNEL_SLACK = 1024

Case = tuple[Callable[[], nn.Module], Any, Callable[..., torch.Tensor]]
CASES: dict[str, Case] = {
    "gpt": (lambda: tiny_gpt(dropout=0.1, n_layer=3), token_batch(4, 16), gpt_loss),
    "cnn-batchnorm": (lambda: SmallCNN(ch=8, n_blocks=3), image_batch(4, 16), cnn_loss),
    "mlp-dropout": (lambda: DropoutMLP(width=32, n_blocks=4), vector_batch(8, 32), mse_loss),
}


def _planner_profile(
    model: nn.Module, batch: Any, loss: Callable[..., torch.Tensor], opt: Any, p: str
) -> Profile:
    with preserved(model, opt):
        prof = Profiler(model, batch, loss, opt, Precision(p))  # type: ignore[arg-type]
        prof.twin_memory = True
        prof.none()
        prof.modes(["selective", "full"])
        prof.time(1)
        return prof.result()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_planners_twin_holds_the_bytes_real_steps_measure(name: str, precision: str) -> None:
    build, batch, loss = CASES[name]
    model = build()
    opt = torch.optim.AdamW(model.parameters())
    twin = _planner_profile(model, batch, loss, opt, precision)
    real = memfit.profile(model, batch, loss, opt, precision, repeats=1)
    assert (twin.memory_from, twin.plain_fits) == ("fake tensors", True)
    assert (real.memory_from, real.plain_fits) == ("tracked", True)
    assert 0 <= real.measured_peak_bytes - twin.measured_peak_bytes <= KERNEL_SLACK
    for a, b in zip(twin.blocks, real.blocks, strict=True):
        assert a.saved_bytes.keys() == b.saved_bytes.keys() == a.backward_peak_bytes.keys()
        for mode in a.saved_bytes:
            assert abs(a.saved_bytes[mode] - b.saved_bytes[mode]) <= KERNEL_SLACK, (a.name, mode)
            assert abs(a.backward_peak_bytes[mode] - b.backward_peak_bytes[mode]) <= KERNEL_SLACK, (
                a.name,
                mode,
            )
    for mode in ("none", "selective", "full"):
        gap = simulate(real, mode).peak_bytes - simulate(twin, mode).peak_bytes
        assert 0 <= gap <= KERNEL_SLACK, (mode, gap)
    assert twin.step_seconds > 0, "the step is still timed for real"


def test_a_plan_with_room_to_spare_tracks_only_its_check() -> None:
    model, batch = tiny_gpt(n_layer=4), token_batch(8, 16)
    opt = torch.optim.AdamW(model.parameters())
    plain = memfit.measure(model, batch, gpt_loss, opt, "fp32", steps=1).peak_bytes
    p = memfit.plan(model, batch, gpt_loss, "60%", opt, "fp32")
    assert (p.report.baseline_from, p.report.baseline_fits) == ("fake tensors", True)
    assert p.report.baseline_peak_bytes == plain
    tracked = [m for m in p.report.measured if "tracked step" in m]
    assert tracked == [m for m in tracked if "of the chosen plan" in m] and len(tracked) == 1, (
        p.report.measured
    )
    assert p.report.measured_peak_bytes == p.predicted_peak_bytes <= p.budget_bytes
    assert not any("does not fit" in n for n in p.notes), p.notes


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.AdamW(ps, amsgrad=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, foreach=False),
    ],
    ids=["adamw-amsgrad", "sgd-momentum", "adam-for-loop"],
)
def test_twin_takes_the_real_optimizer_state_and_measures_the_bytes_a_state_made_on_it_holds(
    make_opt: Callable[[Any], torch.optim.Optimizer],
) -> None:
    """See Note [the twin's optimizer state]: fake copies of the real state (no fake step to
    create it) give the plain step the same peak, to the byte, as a state the twin creates."""
    from memfit.measuring.phases import phased_step
    from memfit.measuring.preserve import create_optimizer_state
    from memfit.measuring.twin import make_twin

    model = tiny_gpt(n_layer=3)
    batch = token_batch(4, 16)
    opt = make_opt(model.parameters())
    peaks = []
    for with_state in (False, True):
        with preserved(model, opt):
            if with_state:
                create_optimizer_state(model, opt)
            twin = make_twin(model, opt, batch)
            assert twin.optimizer is not None and bool(twin.optimizer.state) == with_state
            with twin.running():
                create_optimizer_state(twin.model, twin.optimizer)  # a no-op where copied
                step = phased_step(twin.model, twin.batch, gpt_loss, twin.optimizer, Precision("fp32"), [])
            peaks.append(step.peak)
    assert peaks[0] == peaks[1]
    assert not opt.state  # preserved put the real optimizer back
