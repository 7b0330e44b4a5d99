"""A model with the loss function and batches that go with it: what a model factory returns.

``memfit train``'s ``model.name = "import:package.module:factory"`` calls the factory; it
returns an ``nn.Module`` (trained on the text corpus like the built-in GPT) or a
:class:`ModelSpec` that brings its own loss function and batches (see docs/training.md).

Example:
    >>> import torch
    >>> spec = ModelSpec(torch.nn.Linear(4, 1), lambda m, b: m(b).pow(2).mean(),
    ...                  make_batch=lambda n, seed: torch.ones(n, 4))
    >>> spec.loss_fn(spec.model, spec.random_batch(2)).ndim
    0
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.step import Batch, LossFn

__all__ = ["ModelSpec"]


@dataclass
class ModelSpec:
    """A model with the loss function and batches that go with it.

    ``make_batch(batch_size, seed)`` returns a batch of synthetic data; for a language
    model (``seq_len`` set) batches normally come from the text corpus instead.
    """

    model: nn.Module
    loss_fn: LossFn
    make_batch: Callable[[int, int], Batch] | None = None
    seq_len: int | None = None
    vocab_size: int = 256

    def random_batch(self, batch_size: int, seed: int = 0) -> Batch:
        """A batch of the right shape: the spec's own, or random tokens for a language model."""
        if self.make_batch is not None:
            return self.make_batch(batch_size, seed)
        if self.seq_len is None:
            raise ConfigError(
                "this model brings no batches; its factory must return a ModelSpec with make_batch."
            )
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, self.vocab_size, (batch_size, self.seq_len + 1), generator=g)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()
