"""FLOPs counted with identical blocks run once equal FLOPs counted with every block run.

The profile counts a step's FLOPs with the blocks that have a stand-in passed through
(:func:`memfit.measuring.repeated_blocks.stand_ins`) and gives each the counts of the block
standing in for it (:func:`memfit.measuring.flops.stood_in`). These tests count the same step
with every block run and compare, block by block and in all. The Hugging Face and vision
models are in ``tests/integrations/test_flops_stand_ins_zoo.py``.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from memfit.measuring.flops import block_flops, count_flops
from memfit.measuring.profile import Profiler
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.precision import Precision


def flops_agree(model: nn.Module, batch: object, loss_fn: object) -> dict[str, str]:
    """Assert the profile's FLOPs (identical blocks run once) equal a count with every block run;
    the stand-ins the profile used."""
    optimizer = torch.optim.AdamW(model.parameters())
    prof = Profiler(model, batch, loss_fn, optimizer, Precision("fp32"))  # type: ignore[arg-type]
    assert prof.estimated_peak() is not None, prof.twin_error
    est = prof.estimate
    assert est is not None
    every = count_flops(model, batch, loss_fn, Precision("fp32"))  # type: ignore[arg-type]
    root = type(model).__name__
    got = block_flops(est.forward_flops, est.total_flops, root, prof.blocks)
    want = block_flops(every["forward"], every["total"], root, prof.blocks)
    assert got == want
    assert est.total_flops["Global"] == every["total"]["Global"]
    assert est.forward_flops["Global"] == every["forward"]["Global"]
    assert all(p.grad is None for p in model.parameters())  # the counting step's gradients dropped
    return prof.stand_in


def test_gpt_flops_with_identical_blocks_run_once_equal_every_block_run() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=5, n_embd=64, n_head=4, block_size=32, dropout=0.1))
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    stood = flops_agree(model, (x, x), gpt_loss)
    assert stood == {"blocks.1": "blocks.0", "blocks.2": "blocks.0", "blocks.3": "blocks.0"}


def test_blocks_of_different_shapes_all_run_for_their_flops() -> None:
    torch.manual_seed(0)
    widths = [8, 16, 8, 16, 8]
    model = nn.Sequential(*[nn.Linear(a, b) for a, b in itertools.pairwise(widths)])
    stood = flops_agree(model, torch.randn(4, 8), lambda m, b: m(b).pow(2).mean())
    assert stood == {}
