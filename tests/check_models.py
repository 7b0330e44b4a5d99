"""Test models for the stability check: one that overflows fp16, factories for the CLI."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from memfit.models.gpt import GPT, GPTConfig
from memfit.models.spec import ModelSpec

FACTOR = 1e5


class Amplify(nn.Module):
    """Multiplies its input by a constant: past 65504 in fp16 when |x| > 0.66."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class LoudMLP(nn.Module):
    """Linear -> x1e5 -> /1e5 -> Linear: fine in fp32 and bf16, inf in fp16 at ``body.1``."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), Amplify(FACTOR), Amplify(1 / FACTOR), nn.GELU())
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


def loud_mlp() -> LoudMLP:
    torch.manual_seed(0)
    return LoudMLP()


def vector_batches(n: int, width: int = 16, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(n)]


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)


_calls = itertools.count()


def drifting_gpt() -> GPT:
    """A factory that seeds itself differently on every call: its models cannot be compared."""
    torch.manual_seed(next(_calls))
    return GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8))


def loud_spec() -> ModelSpec:
    """The overflowing MLP with its loss and batches, for ``model.name = import:...``."""
    width = 16

    def make_batch(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch_size, width, generator=g), torch.randn(batch_size, 1, generator=g)

    return ModelSpec(model=LoudMLP(width), loss_fn=mse, make_batch=make_batch)


class _NaNAtBatch:
    """Forward hook: NaN out of a block on the n-th distinct training batch (replays see it again)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.seen: list[float] = []

    def __call__(
        self, module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> torch.Tensor | None:
        if not module.training or self.at <= 0:
            return None
        key = float(args[0].detach().double().sum())
        if key not in self.seen:
            self.seen.append(key)
        return out * float("nan") if self.seen.index(key) + 1 == self.at else None


def nan_gpt() -> GPT:
    """A small GPT whose ``blocks.1`` outputs NaN on training batch ``$MEMFIT_TEST_NAN_AT`` (0: never)."""
    import os

    model = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=16))
    model.blocks[1].register_forward_hook(_NaNAtBatch(int(os.environ.get("MEMFIT_TEST_NAN_AT", "0"))))
    return model
