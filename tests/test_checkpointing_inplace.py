"""Checkpointing stays exact when a block writes in place, or its caller changes its arguments."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memfit
from memfit.checkpointing.hf import without_caches
from memfit.checkpointing.recompute import copies_made
from memfit.measuring.inplace import inplace_parts
from memfit.stepmodel import simulate

#: The recompute runs the very same fp32 kernels on the very same inputs.
TOL = {"rtol": 1e-6, "atol": 1e-7}


class WritesInput(nn.Module):
    """Overwrites its input first (``x.relu_()``), as timm Xception-style blocks do."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.relu_()
        return self.norm(self.lin(x)) + x


class WritesKept(nn.Module):
    """An in-place activation on a convolution output, and ``+=`` on another (timm SE, ResNet)."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv, self.act, self.proj = (
            nn.Conv2d(ch, ch, 3, padding=1),
            nn.SiLU(inplace=True),
            nn.Conv2d(ch, ch, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(self.act(self.conv(x)))
        y += x
        return y


class WritesKeptDeep(nn.Module):
    """A convolution, an in-place activation on its output, then several cheap ops to recompute."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv, self.act, self.norm = (
            nn.Conv2d(ch, ch, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.GroupNorm(2, ch),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.act(self.conv(x)))
        return x + torch.sigmoid(y) * torch.tanh(y) * nn.functional.gelu(y)


class ListLayer(nn.Module):
    """Takes the list of all earlier features, like torchvision's DenseNet layers."""

    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.norm, self.conv = nn.BatchNorm2d(cin), nn.Conv2d(cin, growth, 1)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.conv(torch.relu(self.norm(torch.cat(features, 1))))


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({f"layer{i}": ListLayer(4 + 2 * i, 2) for i in range(3)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers.values():
            features.append(layer(features))  # the list every layer got grows afterwards
        return torch.cat(features, 1)


def _writes_input() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), WritesInput(8), WritesInput(8), nn.Linear(8, 1))


def _writes_kept() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 1), WritesKept(4), WritesKept(4))


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "writes_input": (_writes_input, lambda: torch.randn(4, 8)),
    "writes_kept_output": (_writes_kept, lambda: torch.randn(2, 3, 6, 6)),
    "growing_list_densenet": (Dense, lambda: torch.randn(2, 4, 5, 5)),
}


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, {n: b.clone() for n, b in model.named_buffers()}


@pytest.mark.parametrize("variant", [{"mode": "full"}, {"mode": "selective"}, {"mode": "full", "every": 2}])
@pytest.mark.parametrize("case", list(CASES))
def test_in_place_writes_and_growing_lists_keep_gradients_exact(case: str, variant: dict[str, Any]) -> None:
    make, data = CASES[case]
    torch.manual_seed(0)
    plain, x = make(), data()
    ckpt = memfit.checkpoint(copy.deepcopy(plain), **variant)
    ref = _step(plain, x)
    out = _step(ckpt, x)
    torch.testing.assert_close(out[0], ref[0], **TOL)
    assert out[1].keys() == ref[1].keys()
    for part in (1, 2):  # gradients, then buffers (BatchNorm statistics updated once)
        for name in ref[part]:
            torch.testing.assert_close(out[part][name], ref[part][name], **TOL, msg=name)


def test_copies_are_made_only_for_what_is_written() -> None:
    torch.manual_seed(0)
    model = memfit.checkpoint(_writes_input(), mode="full")
    _step(model, torch.randn(4, 8))
    assert copies_made(model[1]) == {"its input"}
    model = memfit.checkpoint(_writes_kept(), mode="selective")
    _step(model, torch.randn(2, 3, 6, 6))
    assert copies_made(model[1]) == {"the output of convolution that selective checkpointing keeps"}
    model = memfit.checkpoint(_writes_kept(), mode="full")
    _step(model, torch.randn(2, 3, 6, 6))
    assert copies_made(model[1]) == set()


def test_profile_finds_in_place_writes_and_the_plan_says_why() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), WritesKeptDeep(8), WritesKeptDeep(8), WritesKeptDeep(8))
    batch = (torch.randn(8, 3, 16, 16),)
    loss = lambda m, b: m(b[0]).square().mean()  # noqa: E731
    prof = memfit.profile(model, batch, loss, None, "fp32", repeats=1)
    notes = [n for n in prof.notes if inplace_parts(n)[0]]
    assert [inplace_parts(n) for n in notes] == [(["1", "2", "3"], ["selective"])]
    # A plan that uses selective for these blocks says why it is exact; keeping them needs no note.
    only_selective = copy.deepcopy(prof)
    for block in only_selective.blocks:
        del block.saved_bytes["full"]
    # without a time model, micro-batches are only where nothing fits the batch whole
    # (See Note [micro-batches where they are faster] in memfit/planning/choose.py)
    only_selective.speed = None
    tight = simulate(only_selective, ["selective"] * 3).peak_bytes
    plan = memfit.plan(model, batch, loss, tight, precision="fp32", profiles={"fp32": only_selective})
    assert set(plan.blocks.values()) == {"selective"}
    assert [n for n in plan.notes if inplace_parts(n)[0]] == notes
    assert plan.measured_peak_bytes <= tight
    roomy = memfit.plan(
        model, batch, loss, prof.measured_peak_bytes, precision="fp32", profiles={"fp32": prof}
    )
    assert set(roomy.blocks.values()) == {"none"}
    assert not [n for n in roomy.notes if inplace_parts(n)[0]]


class Leaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def test_caller_changing_an_input_after_the_forward_is_a_clear_error() -> None:
    model = memfit.checkpoint(nn.Sequential(Leaky(), Leaky()), mode="full")
    x = torch.randn(2, 4, requires_grad=True)
    h = x * 1
    y = model[1](h)
    h.add_(1.0)  # the caller changes the block's input after the block returned
    with pytest.raises(
        RuntimeError, match="input of the checkpointed block Leaky was modified in place after"
    ):
        y.sum().backward()


def test_cache_arguments_are_turned_off() -> None:
    args, kwargs, changed = without_caches((1,), {"use_cache": True, "cache": object(), "layer_past": None})
    assert kwargs == {"use_cache": False, "cache": None, "layer_past": None} and args == (1,)
    assert changed == ["use_cache", "cache"]
    assert without_caches((1,), {"use_cache": False}) == ((1,), {"use_cache": False}, [])
