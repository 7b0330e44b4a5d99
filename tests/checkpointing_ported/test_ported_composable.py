"""PyTorch's ``test/distributed/_composable/test_checkpoint.py`` CPU cases, ported to ``memfit.checkpoint``.

The composable API checkpoints a submodule in place, as memfit does; each case runs in full
and in selective mode and is compared with the plain model exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ported import MODES, check
from torch import nn


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(100, 100)
        self.seq = nn.Sequential(nn.ReLU(), nn.Linear(100, 100), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(self.l1(x))


@pytest.mark.parametrize("mode", MODES)
def test_tensor_only_cpu(mode: str) -> None:
    """test_tensor_only_cpu: a Sequential submodule checkpointed in place."""

    def case(m: nn.Module) -> Any:
        x = torch.randn(20, 100, requires_grad=True)
        loss = m(x).sum()
        loss.backward()
        return loss, x.grad

    check(ToyModel, ["seq"], mode, case)


class RandomModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(100, 100))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(self.p, torch.randn(100, 100, device=self.p.device))
        return torch.matmul(x, y)


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = RandomModel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("mode", MODES)
def test_random_cpu(mode: str) -> None:
    """test_random_cpu: random numbers drawn inside the block are drawn again, the same, in the recompute."""

    def case(m: nn.Module) -> Any:
        x = torch.randn(20, 100, requires_grad=True)
        m(x).sum().backward()
        return x.grad

    check(Wrapped, ["net"], mode, case)


class MultiOutputModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(100, 100)), nn.Parameter(torch.randn(100, 100))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = nn.functional.relu(x @ self.w1) @ self.w2
        return z.sin(), z.cos()


class MultiInputModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(100, 100))

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = xs
        return nn.functional.relu((x + y) @ self.w)


@pytest.mark.parametrize("mode", MODES)
def test_multi_args(mode: str) -> None:
    """test_multi_args: blocks with several outputs feeding blocks that take a tuple."""

    def make() -> nn.Module:
        return nn.Sequential(MultiOutputModel(), MultiInputModel(), MultiOutputModel(), MultiInputModel())

    def case(m: nn.Module) -> Any:
        x = torch.randn(20, 100, requires_grad=True)
        m(x).sum().backward()
        return x.grad

    check(make, ["0", "2"], mode, case)
