"""A cache flag passed by position (issue 27, case 1): recompute never runs a stateful path.

Hugging Face RecurrentGemma calls its layers as ``layer(h, position, mask, use_cache, cache)``;
a layer that updates its recurrent state when ``use_cache`` is on would do so again in the
recompute, and checkpointing would fail (or train on another state). memfit turns the flag off
for checkpointed blocks however it is passed, as Hugging Face's own checkpointing does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memfit

RTOL, ATOL = 1e-5, 1e-6


class StatefulLayer(nn.Module):
    """With ``use_cache``, keeps a running state across calls (and reads it): a cache."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.state: torch.Tensor | None = None

    def forward(
        self, h: torch.Tensor, position: int, mask: torch.Tensor | None, use_cache: bool, cache: object
    ) -> torch.Tensor:
        out = torch.tanh(self.proj(h))
        if use_cache:
            prev = self.state if self.state is not None else torch.zeros_like(out)
            out = out + 0.5 * prev
            self.state = out.detach()
        return out


class Recurrent(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(StatefulLayer(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, use_cache: bool = True) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, i, None, use_cache, None)
        return self.head(x)


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch, use_cache=False).pow(2).mean()


def _loss_with_cache_on(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_positional_use_cache_is_off_in_checkpointed_blocks(mode: str) -> None:
    torch.manual_seed(0)
    model = Recurrent()
    ref = copy.deepcopy(model)
    batch = torch.randn(4, 8)
    memfit.checkpoint(model, mode=mode)  # type: ignore[arg-type]
    loss = _loss_with_cache_on(model, batch)  # the model passes use_cache=True by position
    loss.backward()
    expected = _loss(ref, batch)  # what training with the cache off computes
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)
    assert all(layer.state is None for layer in model.layers)  # no state was kept


def test_without_checkpointing_the_flag_is_left_alone() -> None:
    model = Recurrent()
    _loss_with_cache_on(model, torch.randn(2, 8))
    assert all(layer.state is not None for layer in model.layers)
