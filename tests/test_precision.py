"""Precision: modes, autocast, the loss scaler, fp32-kept modules, clear errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_gpt, token_batch
from torch import nn

import memfit.precision.core as precision_module
from memfit import Precision
from memfit.devices import device_facts
from memfit.errors import ConfigError, UnsupportedPrecision
from memfit.models.gpt import gpt_loss


def test_unknown_mode_lists_the_modes() -> None:
    with pytest.raises(
        UnsupportedPrecision, match="unknown precision 'fp8'; use one of fp32, bf16, fp16, auto"
    ):
        Precision("fp8")


def test_fp32_is_a_no_op_path() -> None:
    p = Precision("fp32", device="cpu")
    assert not p.scaler.is_enabled()
    with p.autocast():
        assert not torch.is_autocast_enabled("cpu")
    loss = torch.tensor(2.0)
    assert p.scaler.scale(loss) is loss


@pytest.mark.parametrize(("mode", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_dtype(mode: str, dtype: torch.dtype) -> None:
    p = Precision(mode, device="cpu")
    with p.autocast():
        out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == dtype
    assert p.scaler.is_enabled() == (mode == "fp16")


def test_auto_resolves_from_device_facts_with_a_reason() -> None:
    p = Precision("auto", device="cpu")
    facts = device_facts("cpu")
    expected = "bf16" if facts.bf16_native else "fp32"
    assert p.mode == expected
    assert p.reason and ("natively" in p.reason or "fp32 is fastest" in p.reason)


def test_unsupported_precision_names_the_alternative(monkeypatch: pytest.MonkeyPatch) -> None:
    old_gpu = dataclasses.replace(device_facts("cpu"), name="cpu", bf16_runs=False, bf16_native=False)
    monkeypatch.setattr(precision_module, "device_facts", lambda device=None: old_gpu)
    with pytest.raises(UnsupportedPrecision, match="cannot run bf16; use 'fp16'"):
        Precision("bf16")


def test_scaler_state_dict_round_trip() -> None:
    p = Precision("fp16", device="cpu")
    p.scaler.scale(torch.tensor(1.0))  # the scale tensor is created lazily
    p.scaler.update(1024.0)
    q = Precision("fp16", device="cpu")
    q.load_state_dict(p.state_dict())
    assert q.scaler.get_scale() == 1024.0
    with pytest.raises(ConfigError, match="set precision to 'fp16' to resume"):
        Precision("bf16", device="cpu").load_state_dict(p.state_dict())


def test_fp16_step_with_inf_gradient_is_skipped_and_scale_halves() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = Precision("fp16", device="cpu")
    before = model.weight.detach().clone()
    with p.autocast():
        loss = model(torch.randn(3, 4)).sum()
    p.scaler.scale(loss).backward()
    model.weight.grad[0, 0] = float("inf")
    scale = p.scaler.get_scale()
    p.scaler.step(opt)
    p.scaler.update()
    assert torch.equal(model.weight, before), "the step with an inf gradient must be skipped"
    assert p.scaler.get_scale() == scale / 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.a(x))


@pytest.mark.parametrize("spec", ["head", nn.Linear])
def test_fp32_modules_run_in_fp32_under_autocast(spec: str | type[nn.Module]) -> None:
    model = _Net()
    seen: dict[str, torch.dtype] = {}
    # The hook sees the output: fp32 means autocast was off and the bf16 input was cast up.
    model.head.register_forward_hook(lambda m, i, o: seen.update(head_out=o.dtype))
    p = Precision("bf16", device="cpu", fp32_modules=[spec])
    p.attach(model)
    with p.autocast():
        model(torch.randn(2, 4))
    assert seen == {"head_out": torch.float32}
    Precision.detach(model)
    with p.autocast():
        model(torch.randn(2, 4))
    assert seen["head_out"] == torch.bfloat16


def test_fp32_modules_compose_with_checkpointing() -> None:
    import memfit

    model = tiny_gpt()
    p = Precision("bf16", device="cpu", fp32_modules=["blocks.1.mlp"])
    memfit.checkpoint(model, mode="full")
    p.attach(model)
    with p.autocast():
        loss = gpt_loss(model, token_batch())
    loss.backward()
    memfit.uncheckpoint(model)
    assert "forward" in vars(model.blocks[1].mlp)  # the fp32 layer stays
    Precision.detach(model)
    assert "forward" not in vars(model.blocks[1].mlp)


def test_unknown_fp32_module_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="did you mean 'head'"):
        Precision("bf16", device="cpu", fp32_modules=["haed"]).attach(_Net())


def test_each_precision_is_one_object_listed_once() -> None:
    """The registry holds vocab's precisions in its order, and each kind owns its autocast, its
    scaler and its step (fp16 alone scales the loss; fp32's autocast is a no-op context)."""
    from memfit.precision import PRECISION_KINDS
    from memfit.vocab import PRECISIONS

    assert tuple(PRECISION_KINDS) == PRECISIONS
    assert [k.name for k in PRECISION_KINDS.values() if k.loss_scaled] == ["fp16"]
    for name, kind in PRECISION_KINDS.items():
        p = Precision(name, device="cpu")
        assert p.kind is kind and p.dtype == kind.dtype and p.scaler.is_enabled() == kind.loss_scaled
        lin = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        with p.autocast():
            loss = lin(torch.ones(2, 4)).float().sum() * 1e-3  # no fp16 overflow at the first scale
        p.backward(loss)
        before = lin.weight.detach().clone()
        assert p.optimizer_step(opt) is False and not torch.equal(before, lin.weight)
