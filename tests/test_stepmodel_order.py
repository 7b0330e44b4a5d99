"""The step model follows the order blocks ran in, and random depth at its worst.

Two towers defined in one order and run in the other (CLIP's text and vision towers), a side
head hanging off the chain (GoogLeNet's auxiliary classifiers), and LayerDrop (Wav2Vec2's
whole layers skipped at random in training): each profile's plain peak is the measured one,
and a plan's prediction holds when measured.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.measuring.depth import every_layer_runs, layer_drops
from memfit.stepmodel import simulate

#: How far a plan's measured peak may be from its prediction (the zoo's bound).
PREDICTION = 0.05


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Tower(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class TwoTowers(nn.Module):
    """The text tower is defined first, the (wider) image tower runs first."""

    def __init__(self) -> None:
        super().__init__()
        self.text, self.image = Tower(16, 2), Tower(48, 3)
        self.text_in, self.image_in = nn.Linear(8, 16), nn.Linear(8, 48)
        self.text_out, self.image_out = nn.Linear(16, 8), nn.Linear(48, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        image = self.image_out(self.image(self.image_in(x)))
        text = self.text_out(self.text(self.text_in(x)))
        return (image @ text.transpose(-1, -2)).logsumexp(-1)


class Dropping(nn.Module):
    """Whole layers skipped with probability ``layerdrop`` in training (Hugging Face's LayerDrop)."""

    def __init__(self, layerdrop: float = 0.3) -> None:
        super().__init__()
        self.layerdrop = layerdrop
        self.inp = nn.Linear(8, 32)
        self.layers = nn.ModuleList(Layer(32) for _ in range(4))
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            if not (self.training and torch.rand([]) < self.layerdrop):
                h = layer(h)
        return self.out(h)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _batch(rows: int = 32) -> torch.Tensor:
    return torch.randn(rows, 24, 8, generator=torch.Generator().manual_seed(0))


def _plan_holds(model: nn.Module, x: torch.Tensor) -> tuple[memfit.Profile, int, int]:
    """Profile, then plan halfway between full and keep: (profile, predicted, measured)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = memfit.profile(model, x, _loss, opt, "fp32", repeats=1)
    full = simulate(prof, "full").peak_bytes
    budget = (full + prof.measured_peak_bytes) // 2
    plan = memfit.plan(model, x, _loss, budget, opt, "fp32", profiles={"fp32": prof}, check=False)
    memfit.apply(model, plan)
    measured = memfit.measure(model, x, _loss, opt, "fp32", steps=1, micro_batches=plan.micro_batches)
    memfit.uncheckpoint(model)
    return prof, plan.predicted_peak_bytes, measured.peak_bytes


def test_two_towers_are_profiled_in_the_order_they_ran() -> None:
    torch.manual_seed(0)
    model = TwoTowers()
    found = memfit.find_blocks(model)
    assert found[0].startswith("text.")  # module order: the text tower first
    prof, predicted, measured = _plan_holds(model, _batch())
    assert [b.name for b in prof.blocks] == [b for b in found if b.startswith("image.")] + [
        b for b in found if b.startswith("text.")
    ]
    assert prof.chain_links == [True, True, False, True]  # no segment across the towers
    assert simulate(prof, "none").peak_bytes == prof.measured_peak_bytes
    assert measured <= predicted * (1 + PREDICTION) and abs(measured - predicted) <= PREDICTION * predicted


def test_every_checkpointing_mode_of_two_towers_is_predicted() -> None:
    torch.manual_seed(0)
    model, x = TwoTowers(), _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = memfit.profile(model, x, _loss, opt, "fp32", repeats=1)
    for mode in ("full", "selective"):
        memfit.checkpoint(model, mode=mode)
        measured = memfit.measure(model, x, _loss, opt, "fp32", steps=1).peak_bytes
        memfit.uncheckpoint(model)
        predicted = simulate(prof, mode).peak_bytes
        assert abs(measured - predicted) <= PREDICTION * measured, (mode, predicted, measured)


def test_layerdrop_is_profiled_at_its_worst_and_put_back() -> None:
    torch.manual_seed(0)
    model, x = Dropping(), _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = memfit.profile(model, x, _loss, opt, "fp32", repeats=1)
    assert model.layerdrop == 0.3 and len(layer_drops(model)) == 1
    with every_layer_runs(model):
        worst = memfit.measure(model, x, _loss, opt, "fp32", steps=1).peak_bytes
    assert prof.measured_peak_bytes == worst == simulate(prof, "none").peak_bytes
    peaks, ran = [], []
    for seed in range(6):
        torch.manual_seed(seed)
        calls: list[int] = []
        hooks = [m.register_forward_pre_hook(lambda *_, c=calls: c.append(1)) for m in model.layers]
        peaks.append(memfit.measure(model, x, _loss, opt, "fp32", steps=1).peak_bytes)
        ran.append(len(calls))
        for h in hooks:
            h.remove()
    assert all(p <= worst for p in peaks)
    assert min(ran) < 4 * 2 and min(peaks) < worst  # some step did skip a layer: the depth is random


@pytest.mark.parametrize("layerdrop", [0.0, 0.3])
def test_a_plan_under_layerdrop_is_safe(layerdrop: float) -> None:
    torch.manual_seed(0)
    model = Dropping(layerdrop)
    torch.manual_seed(3)
    prof, predicted, measured = _plan_holds(model, _batch())
    assert not any(prof.chain_links) if layerdrop else all(prof.chain_links)  # may be skipped: no chain
    assert measured <= predicted
    if layerdrop == 0.0:
        assert abs(measured - predicted) <= PREDICTION * predicted
