"""One block timed alone in each mode: what the time model's two fitted prices rest on.

Timing values are never asserted (this machine is noisy); what is: which runs happen, that
each run starts from the same inputs, that the model is left as it was, and that the
profile says what its prices were fitted to.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import tiny_gpt, token_batch
from torch import nn

import memfit
from memfit.checkpointing import checkpointed_blocks
from memfit.measuring.block_timing import MIN_ROUNDS, capture_block_inputs, time_block_modes
from memfit.measuring.preserve import preserved
from memfit.measuring.profile import Profiler
from memfit.models.gpt import gpt_loss
from memfit.precision import Precision
from memfit.stepmodel import time_note


class Cache:
    """Like an HF cache: every layer appends to it in its forward."""

    def __init__(self) -> None:
        self.entries: list[int] = []


class Layer(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.lengths_seen: list[int] = []

    def forward(self, x: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        if cache is not None:
            self.lengths_seen.append(len(cache.entries))
            cache.entries.append(1)
        return x + torch.relu(self.lin(x))


class Stack(nn.Module):
    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 16)
        self.blocks = nn.ModuleList([Layer() for _ in range(3)])
        self.head = nn.Linear(16, 1)
        for p in [*self.embed.parameters(), *self.blocks.parameters()] if frozen else []:
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = Cache()
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, cache=cache)
        return self.head(h)


def _mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def test_each_run_starts_from_the_inputs_the_block_saw() -> None:
    model = Stack()
    x, _ = _batch()
    with capture_block_inputs(model, "blocks.1") as seen:
        model(x)
        model(x)  # only the first call is kept
    block = model.blocks[1]
    assert block.lengths_seen == [1, 1]  # in the model, block 1 finds block 0's entry
    times = time_block_modes(model, "blocks.1", seen, ["none", "selective", "full"], rounds=3)
    assert {m: len(t) for m, t in times.items()} == {"none": 3, "selective": 3, "full": 3}
    # every run without checkpointing (a warm-up, three timed) found the cache as it was, with
    # block 0's entry only: a fresh copy each time (checkpointed, memfit turns a cache off,
    # as Hugging Face's gradient checkpointing does)
    assert block.lengths_seen == [1, 1] + [1] * 4
    assert seen.kwargs["cache"].entries == [1]
    assert checkpointed_blocks(model) == {}  # the block's mode is put back
    assert seen.args[0].grad is None or seen.args[0].requires_grad


def test_a_block_alone_is_timed_within_the_seconds_given_after_the_fewest_rounds() -> None:
    model = Stack()
    x, _ = _batch()
    with capture_block_inputs(model, "blocks.1") as seen:
        model(x)
    quick = time_block_modes(model, "blocks.1", seen, ["none", "full"], rounds=8, within=0.0)
    assert {m: len(t) for m, t in quick.items()} == {"none": MIN_ROUNDS, "full": MIN_ROUNDS}
    whole = time_block_modes(model, "blocks.1", seen, ["none", "full"], rounds=MIN_ROUNDS + 2)
    assert {m: len(t) for m, t in whole.items()} == {"none": MIN_ROUNDS + 2, "full": MIN_ROUNDS + 2}
    assert checkpointed_blocks(model) == {}


def test_a_block_whose_output_needs_no_gradient_cannot_be_timed_alone() -> None:
    model = Stack(frozen=True)
    x, _ = _batch()
    with capture_block_inputs(model, "blocks.0") as seen:
        model(x)
    with pytest.raises(RuntimeError, match="needs no gradient"):
        time_block_modes(model, "blocks.0", seen, ["none", "full"], rounds=1)
    assert checkpointed_blocks(model) == {}


def test_the_profile_falls_back_to_the_micro_benchmarks_and_says_so() -> None:
    model = Stack(frozen=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with preserved(model, opt):
        prof = Profiler(model, _batch(), _mse, opt, Precision("fp32"))
        prof.none()
        prof.modes(["selective", "full"])
        prof.time(1)
        prof.time_checkpointed(1, rounds=2)
        result = prof.result()
    assert any("could not run alone" in m and "micro-benchmark" in m for m in prof.measured)
    assert result.speed is not None and result.speed.full_steps == 0 and result.speed.selective_steps == 0
    assert "run alone" not in time_note(result)


def test_a_profile_names_the_block_its_prices_were_fitted_to() -> None:
    model = tiny_gpt(n_layer=3)
    prof = memfit.profile(
        model, token_batch(4, 16), gpt_loss, torch.optim.AdamW(model.parameters()), repeats=1
    )
    sp = prof.speed
    assert sp is not None and sp.timed_block == "blocks.0"  # identical blocks: the first stands for all
    assert sp.full_steps == sp.selective_steps > 0
    assert "blocks.0 run alone" in time_note(prof)
    assert 0.25 <= sp.recompute_scale <= 4.0
