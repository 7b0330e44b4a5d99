"""Hugging Face GPT-2 with its default settings, a memfit plan and torch.compile trains."""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="memfit[hf] extra (transformers) not installed")

import memfit  # noqa: E402
from memfit.checkpointing.compile import is_compiled  # noqa: E402

pytestmark = pytest.mark.slow


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def test_gpt2_default_config_planned_and_compiled_trains() -> None:
    # NOTE: GPT2Config's defaults (use_cache=True, dropout 0.1, its attention implementation)
    # at a size that compiles quickly on a CPU; weights random, nothing downloaded.
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=64, vocab_size=256)
    assert config.use_cache
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # planned from its profile without the time model, as tests/test_compile.py plans: timed,
    # two micro-batches and a checkpointed block can tie at 75%, and this test compiles the
    # checkpointed blocks (See Note [micro-batches where they are faster] in planning/choose.py)
    prof = memfit.profile(model, x, _loss, opt, repeats=1)
    prof.speed = None
    plan = memfit.plan(model, x, _loss, "75%", opt, precision="fp32", profiles={"fp32": prof})
    assert "full" in plan.blocks.values() or "selective" in plan.blocks.values() or plan.segments
    keys = list(model.state_dict())
    torch._dynamo.reset()
    model, opt = memfit.prepare(model, opt, plan, compile=True)
    losses = [memfit.train_step(model, x, _loss, opt, plan) for _ in range(3)]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[0] > losses[1] > losses[2], losses
    assert is_compiled(model)
    from torch._dynamo.utils import counters

    assert counters["stats"]["unique_graphs"] > 0  # the step ran compiled, not eagerly
    assert list(model.state_dict()) == keys
