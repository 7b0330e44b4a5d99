"""Checkpointing under torch.compile (inductor): the same guarantees as eager.

A model checkpointed by memfit (full, selective, every 2nd block, or a plan) and then
compiled computes the same loss, gradients and buffers as the same model compiled plain,
BatchNorm statistics advance once per step, and state_dict keys do not change.
"""

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
from memfit.checkpointing import checkpointed_blocks
from memfit.models.gpt import gpt_loss
from memfit.records import Plan
from memfit.stepmodel import simulate

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_compile_thread")]

# NOTE: the plain and the checkpointed model are different graphs to inductor, which may
# fuse (and so round) a reduction differently in the recompute; equality is to float32
# rounding of the same math, as for bf16 in test_checkpointing.py.
COMPILED_TOL = {"rtol": 1e-5, "atol": 1e-6}
#: Steps per run: BatchNorm's num_batches_tracked must read exactly this afterwards.
STEPS = 2


class InplaceBlock(nn.Module):
    """conv -> BatchNorm -> in-place ReLU (on an output selective keeps) -> conv, residual,
    with an in-place ReLU on the branch's output: what torchvision and timm blocks do."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(ch)
        self.act = nn.ReLU(inplace=True)
        self.proj = nn.Conv2d(ch, ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.act(self.bn(self.conv(x)))).relu_()


class InplaceCNN(SmallCNN):
    """SmallCNN with in-place blocks."""

    def __init__(self, ch: int = 8, n_blocks: int = 3) -> None:
        super().__init__(ch=ch, n_blocks=n_blocks)
        self.blocks = nn.Sequential(*[InplaceBlock(ch) for _ in range(n_blocks)])


Case = tuple[Callable[[], nn.Module], Callable[..., torch.Tensor], Any]
CASES: dict[str, Case] = {
    "gpt": (lambda: tiny_gpt(n_layer=3), gpt_loss, token_batch()),
    "cnn_batchnorm_inplace": (lambda: _seeded(InplaceCNN, n_blocks=3), cnn_loss, image_batch()),
    "mlp_dropout": (lambda: _seeded(DropoutMLP, n_blocks=3), mse_loss, vector_batch(batch=256)),
}
VARIANTS = ["full", "selective", "every2", "segment", "planned"]


def _seeded(cls: Callable[..., nn.Module], **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    return cls(**kwargs)


Run = list[tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]]


def _train(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: Any) -> Run:
    """Compile ``model`` and take STEPS forward/backward passes from fixed RNG seeds."""
    torch._dynamo.reset()
    compiled = torch.compile(model)
    model.train()
    out: Run = []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        loss = loss_fn(compiled, batch)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        out.append((loss.detach(), grads, buffers))
    return out


_REFERENCE: dict[str, Run] = {}


def _reference(case: str) -> Run:
    if case not in _REFERENCE:
        make, loss_fn, batch = CASES[case]
        _REFERENCE[case] = _train(make(), loss_fn, batch)
    return _REFERENCE[case]


def _checkpointed(case: str, variant: str) -> nn.Module:
    make, loss_fn, batch = CASES[case]
    model = make()
    if variant == "planned":
        # planned in eager mode on a copy (profiling runs steps), a quarter of the way from
        # checkpointing everything to nothing, so the plan checkpoints; then applied to the model
        prof = memfit.profile(copy.deepcopy(model), batch, loss_fn, repeats=1)
        full, none = simulate(prof, "full").peak_bytes, simulate(prof, "none").peak_bytes
        budget = full + (none - full) // 4
        # without a time model, micro-batches are only where nothing fits the batch whole
        # (See Note [micro-batches where they are faster] in memfit/planning/choose.py)
        prof.speed = None
        plan = memfit.plan(
            model, batch, loss_fn, budget, precision="fp32", check=False, profiles={"fp32": prof}
        )
        memfit.apply(model, plan)
    elif variant == "segment":
        # the first two blocks as one checkpoint_sequential-style segment, the last selective
        names = memfit.find_blocks(model)
        blocks = {n: "full" for n in names[:2]} | {n: "selective" for n in names[2:]}
        memfit.apply(model, Plan(blocks=blocks, segments=[names[:2]]))
    else:
        memfit.checkpoint(model, mode="selective" if variant == "selective" else "full")
        if variant == "every2":
            memfit.checkpoint(model, mode="full", every=2)
    return model


#: Models whose blocks form a plain chain (each block's input is the previous one's output),
#: the models a segment applies to; the MLP's blocks are residual branches.
CHAINS = {"gpt", "cnn_batchnorm_inplace"}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_checkpointing_equals_compiled_plain(case: str, variant: str) -> None:
    if variant == "segment" and case not in CHAINS:
        pytest.skip("a segment needs blocks that form a chain")
    ref = _reference(case)
    model = _checkpointed(case, variant)
    keys = set(CASES[case][0]().state_dict())
    assert checkpointed_blocks(model), "nothing was checkpointed"
    got = _train(model, CASES[case][1], CASES[case][2])
    for step, ((ref_loss, ref_grads, ref_bufs), (loss, grads, bufs)) in enumerate(zip(ref, got, strict=True)):
        torch.testing.assert_close(loss, ref_loss, **COMPILED_TOL, msg=f"loss, step {step + 1}")
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], **COMPILED_TOL, msg=name)
        for name in ref_bufs:
            torch.testing.assert_close(bufs[name], ref_bufs[name], **COMPILED_TOL, msg=name)
    tracked = {n: int(b) for n, b in got[-1][2].items() if n.endswith("num_batches_tracked")}
    assert all(v == STEPS for v in tracked.values()), tracked  # once per step, not per recompute
    assert set(model.state_dict()) == keys
