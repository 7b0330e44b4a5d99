"""Checking a plan with PyTorch's MemTracker when the plan has micro-batches (issue 37).

docs/own-loop.md tells a reader to watch a step with ``MemoryWatch``: a bare MemTracker stops
at the second micro-batch's forward, and MemoryWatch gives the same peak as ``memfit.measure``.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import memfit
from memfit.measuring.tracker import MemoryWatch
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.records import Plan


def _planned(micro_batches: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, tuple, Plan]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    x = torch.randint(0, 256, (8, 17))
    batch = (x[:, :-1], x[:, 1:])
    plan = Plan(
        blocks={"blocks.0": "full", "blocks.1": "none"}, precision="fp32", micro_batches=micro_batches
    )
    model, opt = memfit.prepare(model, torch.optim.AdamW(model.parameters()), plan)
    memfit.train_step(model, batch, gpt_loss, opt, plan)  # the optimizer's state exists from here on
    return model, opt, batch, plan


def test_a_bare_memtracker_stops_at_the_second_micro_batch() -> None:
    model, opt, batch, plan = _planned(micro_batches=4)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with pytest.raises(NotImplementedError, match="multiple iterative calls"), tracker:
        memfit.train_step(model, batch, gpt_loss, opt, plan)


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_memory_watch_tracks_a_step_of_any_micro_batches(micro_batches: int) -> None:
    model, opt, batch, plan = _planned(micro_batches)
    with MemoryWatch(model, opt) as watch:
        memfit.train_step(model, batch, gpt_loss, opt, plan)
    measured = memfit.measure(model, batch, gpt_loss, opt, plan.precision, micro_batches=micro_batches)
    assert watch.peak_bytes == measured.peak_bytes > 0
    assert watch.breakdown["optimizer"] > 0  # a steady-state step: the optimizer's state is counted
