"""Blocks not run in module order and random depth, on the models users bring.

torchvision's GoogLeNet trains with two auxiliary classifiers hanging off its chain of
inception blocks (loss = CE(main) + 0.3 * (CE(aux1) + CE(aux2))); Hugging Face's Wav2Vec2
skips whole encoder layers at random in training (``layerdrop = 0.1``, its default). The
step model's predictions hold on both: GoogLeNet's within 5% in every uniform mode and for a
plan halfway between full and keep, Wav2Vec2's at its worst case (every layer run), which
every random step measures at or under.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import memfit
from memfit.measuring.depth import every_layer_runs, layer_drops
from memfit.stepmodel import simulate

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: How far a measured peak may be from its prediction (the zoo's bound).
PREDICTION = 0.05
AUX_WEIGHT = 0.3


def _googlenet_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    out = model(x)  # GoogLeNetOutputs(logits, aux_logits2, aux_logits1) in train mode
    ce = nn.functional.cross_entropy
    return ce(out.logits, y) + AUX_WEIGHT * (ce(out.aux_logits1, y) + ce(out.aux_logits2, y))


def test_googlenet_with_its_auxiliary_heads_is_predicted() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.googlenet(weights=None, aux_logits=True, init_weights=True, num_classes=10)
    model.train()
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(16, 3, 64, 64, generator=g), torch.randint(0, 10, (16,), generator=g))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = memfit.profile(model, batch, _googlenet_loss, opt, "fp32", repeats=1)
    keep = prof.measured_peak_bytes
    assert prof.activation_bytes > keep - prof.activation_bytes, "activations must dominate this batch"
    assert abs(simulate(prof, "none").peak_bytes - keep) <= PREDICTION * keep
    measured = {}
    for mode in ("full", "selective"):
        memfit.checkpoint(model, mode=mode)
        measured[mode] = memfit.measure(model, batch, _googlenet_loss, opt, "fp32", steps=1).peak_bytes
        memfit.uncheckpoint(model)
        predicted = simulate(prof, mode).peak_bytes
        assert abs(predicted - measured[mode]) <= PREDICTION * measured[mode], (mode, predicted, measured)
    budget = (measured["full"] + keep) // 2
    plan = memfit.plan(
        model, batch, _googlenet_loss, budget, opt, "fp32", profiles={"fp32": prof}, check=False
    )
    memfit.apply(model, plan)
    got = memfit.measure(
        model, batch, _googlenet_loss, opt, "fp32", steps=1, micro_batches=plan.micro_batches
    )
    assert got.peak_bytes <= budget
    assert abs(got.peak_bytes - plan.predicted_peak_bytes) <= PREDICTION * plan.predicted_peak_bytes


def test_wav2vec2_layerdrop_is_predicted_at_its_worst() -> None:
    pytest.importorskip("transformers")
    from zoo_order3 import ORDER3

    entry = next(e for e in ORDER3 if e.name == "transformers/wav2vec2")
    model = entry.build()
    assert model.config.layerdrop == 0.1  # the default, untouched
    batch = entry.batch(entry.large)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = memfit.profile(model, batch, entry.loss, opt, "fp32", repeats=1)
    assert model.config.layerdrop == 0.1 and layer_drops(model)  # put back after profiling
    assert not any(prof.chain_links)  # a layer that may be skipped links no chain
    with every_layer_runs(model):
        worst = memfit.measure(model, batch, entry.loss, opt, "fp32", steps=1).peak_bytes
    assert simulate(prof, "none").peak_bytes == prof.measured_peak_bytes == worst
    peaks = []
    for seed in range(8):
        torch.manual_seed(seed)
        peaks.append(memfit.measure(model, batch, entry.loss, opt, "fp32", steps=1).peak_bytes)
    # every random step at or under the prediction, and some step did skip a layer
    assert max(peaks) <= worst and min(peaks) < worst, (peaks, worst)
