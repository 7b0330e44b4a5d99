"""Overflow attribution names the module, phase and dtype of the first non-finite value."""

from __future__ import annotations

import math

import torch
from check_models import loud_mlp, mse, vector_batches
from conftest import tiny_gpt, token_batch
from torch import nn

from memfit.check.attribution import OverflowWatch, attribute, grad_underflow_fractions
from memfit.checkpointing import checkpoint
from memfit.models.gpt import gpt_loss
from memfit.precision import Precision


def _inject_nan(module: nn.Module) -> None:
    module.register_forward_hook(lambda m, args, out: out * float("nan"))


def test_fp16_overflow_names_the_amplifying_module() -> None:
    found = attribute(loud_mlp(), vector_batches(1)[0], mse, Precision("fp16", device="cpu"))
    assert found is not None
    assert (found.module, found.phase, found.dtype, found.value) == ("body.1", "forward", "float16", "inf")


def test_fp32_and_bf16_replays_are_finite() -> None:
    batch = vector_batches(1)[0]
    assert attribute(loud_mlp(), batch, mse, Precision("fp32", device="cpu")) is None
    assert attribute(loud_mlp(), batch, mse, Precision("bf16", device="cpu")) is None


def test_nan_in_a_block_output_names_that_block_also_when_checkpointed() -> None:
    for ckpt in (False, True):
        model = tiny_gpt(n_layer=3)
        if ckpt:
            checkpoint(model, mode="full")
        _inject_nan(model.blocks[1])
        found = attribute(model, token_batch(), gpt_loss, Precision("fp32", device="cpu"))
        assert found is not None
        assert (found.module, found.phase, found.value) == ("blocks.1", "forward", "nan"), ckpt


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return grad * float("inf")


class _BadBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InfGrad.apply(x)


def test_backward_overflow_names_the_module_whose_gradient_broke() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _BadBackward(), nn.Linear(4, 1))
    found = attribute(model, torch.randn(3, 4), lambda m, b: m(b).sum(), Precision("fp32", device="cpu"))
    assert found is not None
    assert (found.module, found.phase, found.dtype) == ("1", "backward", "float32")


def test_non_finite_loss_from_finite_outputs_is_the_loss_phase() -> None:
    model = nn.Linear(4, 1)
    found = attribute(
        model, torch.ones(2, 4), lambda m, b: m(b).sum() / 0.0 * 0.0, Precision("fp32", device="cpu")
    )
    assert found is not None
    assert (found.module, found.phase, found.value) == ("<loss>", "loss", "nan")


def test_attribute_leaves_weights_grads_and_rng_alone() -> None:
    model = loud_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    attribute(model, vector_batches(1)[0], mse, Precision("fp16", device="cpu"))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_watch_removes_its_hooks_and_tracks_ranges() -> None:
    model = loud_mlp()
    with OverflowWatch(model) as watch:
        loss = mse(model, vector_batches(1)[0])
        loss.backward()
        assert watch.end_step(float(loss.detach())) is None
    for m in model.modules():
        assert not m._forward_hooks and not m._backward_hooks
    dtype, peak = watch.ranges["body.1"]
    assert dtype == "float32" and peak > 65504  # fp32 holds it; fp16 would not
    top = watch.module_ranges()[0]
    assert top.module == "body.1" and top.fp16_fraction is not None and top.fp16_fraction > 1


def test_underflow_fraction_falls_as_the_loss_scale_rises() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))

    def tiny_loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).sum() * 1e-9  # gradients far below fp16's smallest subnormal (6e-8)

    x = torch.randn(4, 8)
    low = grad_underflow_fractions(model, x, tiny_loss, 1.0, ["0", "1"])
    high = grad_underflow_fractions(model, x, tiny_loss, 2.0**24, ["0", "1"])
    assert low["1"] == 1.0 and low["0"] == 1.0
    assert high["1"] == 0.0
    assert all(math.isfinite(v) for v in high.values())


class _InplaceBlock(nn.Module):
    """A ResNet-style block that modifies module outputs in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.fc(x))
        out += x
        return self.relu(out)


def test_models_that_modify_outputs_in_place_can_be_watched() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_InplaceBlock(), _InplaceBlock(), nn.Linear(4, 1))
    x = torch.randn(5, 4)
    assert attribute(model, x, lambda m, b: m(b).sum(), Precision("fp32", device="cpu")) is None
    _inject_nan(model[1].fc)
    found = attribute(model, x, lambda m, b: m(b).sum(), Precision("fp32", device="cpu"))
    assert found is not None and (found.module, found.phase) == ("1.fc", "forward")


class _BadBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(32, 32)
        self.bad = _BadBackward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bad(self.inner(x))


def test_backward_overflow_inside_a_checkpointed_block_is_named() -> None:
    model = tiny_gpt(n_layer=2)
    model.blocks[1].mlp = _BadBlock()  # type: ignore[assignment]
    checkpoint(model, mode="full")
    found = attribute(model, token_batch(), gpt_loss, Precision("fp32", device="cpu"))
    assert found is not None
    assert (found.module, found.phase) == ("blocks.1.mlp.bad", "backward")
