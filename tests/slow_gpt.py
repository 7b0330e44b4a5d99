"""A model factory for ``memfit train`` tests: a tiny GPT whose loss waits a little per call,
so a test can kill the training process in the middle of a run."""

from __future__ import annotations

import time

import torch
from torch import nn

from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.models.spec import ModelSpec


def _slow_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    if torch.is_grad_enabled():
        time.sleep(0.05)
    return gpt_loss(model, batch)


def build(seq_len: int = 16, dropout: float = 0.1) -> ModelSpec:
    """A 2-block GPT with dropout (so RNG state matters for resuming)."""
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=seq_len, dropout=dropout))
    return ModelSpec(model=model, loss_fn=_slow_loss, seq_len=seq_len)
