"""torchvision (and timm) models built without weights: blocks, BatchNorm, numerics, plans."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

torchvision = pytest.importorskip("torchvision", reason="vision extra (torchvision) not installed")

import memfit  # noqa: E402

#: Checkpointed and plain steps run the same fp32 kernels; recompute may reorder reductions.
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)


def _ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _images(n: int = 4, size: int = 32, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g)


def _resnet18() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None, num_classes=10)


def _vit() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=3, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
    )


def test_resnet18_blocks_found_across_stages() -> None:
    blocks = memfit.find_blocks(_resnet18())
    assert blocks == [f"layer{s}.{i}" for s in range(1, 5) for i in range(2)]


def test_vit_blocks_found() -> None:
    assert memfit.find_blocks(_vit()) == [f"encoder.layers.encoder_layer_{i}" for i in range(3)]


@pytest.mark.parametrize("factory", [_resnet18, _vit], ids=["resnet18", "vit"])
def test_checkpointed_gradients_and_batchnorm_stats_equal_plain(factory) -> None:  # type: ignore[no-untyped-def]
    plain = factory()
    ckpt = memfit.checkpoint(copy.deepcopy(plain), mode="full")
    batch = _images()
    for model in (plain, ckpt):
        torch.manual_seed(1)
        _ce(model, batch).backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, **GRAD_TOL, msg=lambda m, n=n: f"{n}: {m}")
    # BatchNorm running statistics are updated once, not again by the recompute.
    for (n, a), (_, b) in zip(plain.named_buffers(), ckpt.named_buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.slow
def test_resnet18_plan_at_60_percent_holds_when_measured() -> None:
    # NOTE: parameters + gradients of ResNet-18 are 85 MiB; 60% of the peak leaves room for
    # activations only when they are a large part of it: 208x208 images, plain SGD.
    model = _resnet18()
    batch = _images(8, 208)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = memfit.plan(model, batch, _ce, "60%", opt, precision="fp32")
    memfit.apply(model, plan)
    saves = memfit.checkpointing.checkpointed_blocks(model) or plan.micro_batches > 1
    assert saves, "a 60% budget must checkpoint something or split the batch"
    measured = memfit.measure(model, batch, _ce, opt, "fp32", steps=1, micro_batches=plan.micro_batches)
    assert measured.peak_bytes <= plan.budget_bytes == int(0.6 * plan.report.baseline_peak_bytes)


@pytest.mark.slow
def test_mnasnet_plans_at_50_percent_and_measures_as_predicted() -> None:
    """MNASNet's ``_load_from_state_dict`` refuses a state without its ``_version`` metadata
    (issue 36): planning's snapshot keeps it."""
    torch.manual_seed(0)
    model = torchvision.models.mnasnet0_5(num_classes=10)
    batch = _images(8, 112)
    opt = torch.optim.AdamW(model.parameters())
    plan = memfit.plan(model, batch, _ce, "50%", opt, precision="fp32")
    assert plan.predicted_peak_bytes <= plan.budget_bytes == int(0.5 * plan.report.baseline_peak_bytes)
    memfit.apply(model, plan)
    measured = memfit.measure(model, batch, _ce, opt, "fp32", steps=1, micro_batches=plan.micro_batches)
    assert measured.peak_bytes <= plan.budget_bytes
    assert abs(measured.peak_bytes - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes


def test_timm_resnet_blocks_found() -> None:
    timm = pytest.importorskip("timm", reason="timm not installed")
    model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    assert memfit.find_blocks(model)[:2] == ["layer1.0", "layer1.1"]
