"""The PEFT zoo: every checkpointing and planning promise, on adapter models as users make them.

For each model of :mod:`zoo_peft` (``peft.get_peft_model`` on a Hugging Face model, adapter
dropout on, nothing called first):

- the blocks found are the expected list, under the PeftModel's own names;
- ``full``, ``selective`` and ``every=2`` give the plain model's loss and adapter gradients
  (the recompute replays the adapters' dropout masks), and the frozen base gets no gradient;
- plans at 50% and 25% of the plain peak measure at or under the budget and within 5% of
  their prediction, and training under one leaves the frozen base bit for bit unchanged.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import pytest
import torch
from zoo import PREDICTION, TOL, VARIANTS, Entry
from zoo_peft import PEFT

import memfit
from memfit.checkpointing import checkpointed_blocks

pytest.importorskip("transformers")
pytest.importorskip("peft")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ENTRIES = [pytest.param(e, id=e.name) for e in PEFT]


def _step(model: torch.nn.Module, entry: Entry, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and parameter gradients after one forward/backward from a fixed seed."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # dropout masks (the adapters' and the model's): the recompute replays them
    loss = entry.loss(model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@functools.cache
def _reference(name: str) -> tuple[torch.nn.Module, Any, tuple[Any, ...]]:
    entry = next(e for e in PEFT if e.name == name)
    model = entry.build()
    fresh = copy.deepcopy(model)
    batch = entry.batch(entry.small)
    return fresh, batch, _step(model, entry, batch)


def _trainable(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("entry", ENTRIES)
def test_blocks_found(entry: Entry) -> None:
    assert memfit.find_blocks(entry.build()) == entry.blocks


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("entry", ENTRIES)
def test_checkpointing_is_exact_with_adapter_dropout(entry: Entry, variant: str) -> None:
    fresh, batch, (ref_loss, ref_grads) = _reference(entry.name)
    model = copy.deepcopy(fresh)
    keys = list(model.state_dict())
    memfit.checkpoint(model, **VARIANTS[variant])
    assert checkpointed_blocks(model), "nothing was checkpointed"
    assert list(model.state_dict()) == keys
    loss, grads = _step(model, entry, batch)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    # only the adapters get gradients, checkpointed or not
    assert grads.keys() == ref_grads.keys() == _trainable(model)
    assert all("lora_" in n or "ia3_" in n for n in grads), sorted(grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **TOL, msg=lambda m, n=name: f"grad {n}: {m}")
    memfit.uncheckpoint(model)
    assert list(model.state_dict()) == keys


@pytest.mark.parametrize("fraction", [0.5, 0.25])
@pytest.mark.parametrize("entry", ENTRIES)
def test_plans_at_a_fraction_of_the_plain_peak_hold(entry: Entry, fraction: float) -> None:
    model = entry.build()
    batch = entry.batch(entry.large)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    prof = memfit.profile(model, batch, entry.loss, opt, "fp32", repeats=1)
    keep = prof.measured_peak_bytes
    # no gradients or optimizer state for the frozen base: only the adapters' bytes
    trainable = [p for p in model.parameters() if p.requires_grad]
    adapters = sum(p.numel() * p.element_size() for p in trainable)
    # AdamW: two moments per adapter value and a float32 step counter per adapter tensor
    assert prof.grad_bytes == adapters and prof.optimizer_bytes == 2 * adapters + 4 * len(trainable)
    budget = int(fraction * keep)
    plan = memfit.plan(model, batch, entry.loss, budget, opt, "fp32", profiles={"fp32": prof}, check=False)
    memfit.apply(model, plan)
    micro = plan.micro_batches
    measured = memfit.measure(model, batch, entry.loss, opt, "fp32", steps=1, micro_batches=micro)
    assert measured.peak_bytes <= budget, (plan.blocks, plan.micro_batches, plan.predicted_peak_bytes)
    # DoRA's measured peak moves with where Python's cyclic collector runs in the step
    # (docs/lora.md: seen from 1.5% up to 7.7% over its prediction): held to twice the tolerance
    tolerance = 2 * PREDICTION if entry.name.endswith("-dora") else PREDICTION
    assert abs(measured.peak_bytes - plan.predicted_peak_bytes) <= tolerance * plan.predicted_peak_bytes


@pytest.mark.parametrize("entry", [ENTRIES[0], ENTRIES[-1]])
def test_training_under_a_plan_leaves_the_frozen_base_unchanged(entry: Entry) -> None:
    model = entry.build()
    batch = entry.batch(8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    plan = memfit.plan(model, batch, entry.loss, "50%", opt, "fp32", check=False)
    model, opt = memfit.prepare(model, opt, plan)
    losses = [memfit.train_step(model, batch, entry.loss, opt, plan) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    trainable = _trainable(model)
    for name, p in model.named_parameters():
        if name in trainable:
            continue
        assert torch.equal(p.detach(), before[name]), f"frozen {name} changed"
    # peft starts lora_B at zero; the adapters did train
    assert any(not torch.equal(dict(model.named_parameters())[n].detach(), before[n]) for n in trainable)


class _ThreeLayers(torch.nn.Module):
    """A model of three named layers and no repeated block."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _models() -> list[tuple[str, torch.nn.Module, list[str]]]:
    seq = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    out = [("three layers", _ThreeLayers(), ["a", "b"]), ("sequential", seq, ["0", "2"])]
    tv = pytest.importorskip("torchvision")
    out.append(("resnet18", tv.models.resnet18(num_classes=10), ["conv1", "conv2"]))
    return out


@pytest.mark.parametrize("index", range(3))
def test_adapters_never_change_which_blocks_a_model_has(index: int) -> None:
    """LoRA on a model's own layers finds the plain model's blocks (none for three named
    layers), never the adapters' ``lora_A``/``lora_B`` or the wrapped layers themselves."""
    import peft

    name, model, targets = _models()[index]
    plain = memfit.find_blocks(model)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets))
    assert memfit.find_blocks(wrapped) == [f"base_model.model.{b}" for b in plain], name
