"""Checkpointed models compute the same loss and gradients as plain ones."""

from __future__ import annotations

import copy
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
from memfit.errors import ConfigError
from memfit.models.gpt import gpt_loss

# fp32: the recompute runs the very same kernels on the very same inputs.
FP32_TOL = {"rtol": 1e-6, "atol": 1e-7}
# bf16: a checkpointed bf16 run must match a plain bf16 run, not fp32.
BF16_TOL = {"rtol": 1e-5, "atol": 1e-6}

Case = tuple[Callable[[], nn.Module], Callable[..., torch.Tensor], Any]
CASES: dict[str, Case] = {
    "gpt_dropout": (lambda: tiny_gpt(dropout=0.2, n_layer=4), gpt_loss, token_batch()),
    "cnn_batchnorm": (lambda: SmallCNN(n_blocks=4), cnn_loss, image_batch()),
    "mlp_dropout": (lambda: DropoutMLP(n_blocks=4), mse_loss, vector_batch()),
}
VARIANTS = {
    "full": {"mode": "full"},
    "selective": {"mode": "selective"},
    "every2": {"mode": "full", "every": 2},
}


def _run(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: Any, autocast: bool = False):
    """Loss, param grads and buffers after one forward/backward from a fixed RNG seed."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(99)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_fn(model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return loss.detach(), grads, buffers


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(CASES))
def test_checkpointed_gradients_equal_plain_fp32(case: str, variant: str) -> None:
    make, loss_fn, batch = CASES[case]
    plain = make()
    ckpt = memfit.checkpoint(copy.deepcopy(plain), **VARIANTS[variant])
    assert memfit.checkpointing.checkpointed_blocks(ckpt), "nothing was checkpointed"
    ref_loss, ref_grads, ref_bufs = _run(plain, loss_fn, batch)
    loss, grads, bufs = _run(ckpt, loss_fn, batch)
    torch.testing.assert_close(loss, ref_loss, **FP32_TOL)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **FP32_TOL, msg=name)
    # BatchNorm running statistics (and num_batches_tracked) are updated once, not twice.
    for name in ref_bufs:
        torch.testing.assert_close(bufs[name], ref_bufs[name], **FP32_TOL, msg=name)


@pytest.mark.parametrize("variant", ["full", "selective"])
def test_checkpointed_bf16_autocast_equals_plain_bf16(variant: str) -> None:
    plain = tiny_gpt(dropout=0.1)
    ckpt = memfit.checkpoint(copy.deepcopy(plain), **VARIANTS[variant])
    ref_loss, ref_grads, _ = _run(plain, gpt_loss, token_batch(), autocast=True)
    loss, grads, _ = _run(ckpt, gpt_loss, token_batch(), autocast=True)
    torch.testing.assert_close(loss, ref_loss, **BF16_TOL)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **BF16_TOL, msg=name)


def test_batchnorm_running_stats_updated_once() -> None:
    plain, ckpt = SmallCNN(), memfit.checkpoint(SmallCNN(), mode="full")
    ckpt.load_state_dict(plain.state_dict())
    _run(plain, cnn_loss, image_batch())
    _run(ckpt, cnn_loss, image_batch())
    bn_plain, bn_ckpt = plain.blocks[0].bn, ckpt.blocks[0].bn
    assert int(bn_ckpt.num_batches_tracked) == 1
    torch.testing.assert_close(bn_ckpt.running_mean, bn_plain.running_mean, **FP32_TOL)
    torch.testing.assert_close(bn_ckpt.running_var, bn_plain.running_var, **FP32_TOL)


def test_uncheckpoint_restores_module_tree_and_state_dict_keys() -> None:
    model = tiny_gpt()
    names_before = [(n, type(m)) for n, m in model.named_modules()]
    keys_before = list(model.state_dict())
    dicts_before = {n: set(vars(m)) for n, m in model.named_modules()}
    memfit.checkpoint(model, mode="selective")
    assert list(model.state_dict()) == keys_before
    assert [(n, type(m)) for n, m in model.named_modules()] == names_before
    memfit.uncheckpoint(model)
    assert memfit.checkpointing.checkpointed_blocks(model) == {}
    assert list(model.state_dict()) == keys_before
    assert {n: set(vars(m)) for n, m in model.named_modules()} == dicts_before


def test_checkpoint_twice_does_not_double_wrap() -> None:
    model = tiny_gpt()
    memfit.checkpoint(model, mode="full")
    first = model.blocks[0].forward
    memfit.checkpoint(model, mode="full")
    assert model.blocks[0].forward.func is first.func
    # The inner forward is the class's own, not another checkpoint layer.
    assert model.blocks[0].forward.args[0].__func__ is type(model.blocks[0]).forward
    memfit.checkpoint(model, mode="selective", every=2)
    assert memfit.checkpointing.checkpointed_blocks(model) == {"blocks.0": "selective", "blocks.1": "full"}


def test_saved_weights_load_either_way() -> None:
    plain = tiny_gpt()
    ckpt = memfit.checkpoint(tiny_gpt(), mode="full")
    ckpt.load_state_dict(plain.state_dict())
    plain.load_state_dict(ckpt.state_dict())


def test_deepcopy_of_checkpointed_model_is_independent() -> None:
    model = memfit.checkpoint(tiny_gpt(), mode="full")
    clone = copy.deepcopy(model)
    assert memfit.checkpointing.checkpointed_blocks(clone) == memfit.checkpointing.checkpointed_blocks(model)
    # The copy's wrapper calls the copy's block, not the original's.
    assert clone.blocks[0].forward.args[1].module is clone.blocks[0]
    ref = _run(model, gpt_loss, token_batch())[1]
    out = _run(clone, gpt_loss, token_batch())[1]
    for name in ref:
        torch.testing.assert_close(out[name], ref[name], **FP32_TOL)


def test_eval_mode_without_grad_runs_plain_forward() -> None:
    model = memfit.checkpoint(tiny_gpt(), mode="full")
    x, _ = token_batch()
    with torch.no_grad():
        out = model.eval()(x)
    assert out.shape == (3, 16, 256)


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def test_find_blocks_across_stages_like_resnet() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1),
        nn.Sequential(_Stage(), _Stage()),
        nn.Sequential(_Stage(), _Stage(), _Stage()),
    )
    assert memfit.find_blocks(model) == ["1.0", "1.1", "2.0", "2.1", "2.2"]


def test_find_blocks_examples() -> None:
    assert memfit.find_blocks(tiny_gpt(n_layer=3)) == ["blocks.0", "blocks.1", "blocks.2"]
    assert memfit.find_blocks(SmallCNN(n_blocks=2)) == ["blocks.0", "blocks.1"]
    assert memfit.find_blocks(DropoutMLP(n_blocks=3)) == ["layers.0", "layers.1", "layers.2"]
    assert memfit.find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) == []


def test_unknown_block_name_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"no module named 'no\.such\.block'.*blocks found by find_blocks"):
        memfit.checkpoint(tiny_gpt(), blocks=["no.such.block"])


def test_close_block_name_is_suggested() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'blocks\.1'"):
        memfit.checkpoint(tiny_gpt(), blocks=["block.1"])


def test_model_without_repeated_blocks_is_a_clear_error() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"found no repeated blocks in Sequential.*blocks=\["):
        memfit.checkpoint(model)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [({"mode": "half"}, "unknown checkpointing mode"), ({"every": 0}, "every must be a positive integer")],
)
def test_bad_arguments(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        memfit.checkpoint(tiny_gpt(), **kwargs)
