"""What ``memfit profile`` and ``memfit estimate`` build from a config: model, batch, optimizer."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from memfit.app.build import build_model, store_frozen_base
from memfit.app.config import Config
from memfit.devices import resolve_device
from memfit.models.spec import ModelSpec
from memfit.step import Batch

__all__ = ["batch_for", "describe", "optimizer_fn", "run_device", "spec_for"]


def spec_for(cfg: Config, meta: bool = False) -> ModelSpec:
    """Build the configured model (on the meta device: no memory, for its shapes and loss), its
    frozen base stored as ``model.lora.base`` says (as ``memfit train`` stores it; not on meta)."""
    torch.manual_seed(cfg.train.seed)
    if meta:
        with torch.device("meta"):
            return build_model(cfg.model)
    spec = build_model(cfg.model)
    if cfg.model.lora.rank > 0:
        store_frozen_base(spec.model, cfg.model.lora)
    return spec


def batch_for(spec: ModelSpec, cfg: Config, device: torch.device | None = None) -> Batch:
    """A batch of ``train.batch_size`` random samples of the model's shape."""
    batch = spec.random_batch(cfg.train.batch_size, seed=cfg.train.seed)
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    return type(batch)(t.to(device) for t in batch)


def optimizer_fn(cfg: Config) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """AdamW with the config's settings (what ``memfit train`` uses)."""
    return cfg.optimizer.make


def run_device(cfg: Config) -> torch.device:
    """``train.device``, with ``auto`` resolved to the first GPU or the CPU."""
    return resolve_device(cfg.train.device)


def describe(batch: Batch) -> str:
    """``(8, 128)`` style shapes of the batch's tensors."""
    tensors = [batch] if isinstance(batch, torch.Tensor) else list(batch)
    return " + ".join(str(tuple(t.shape)) for t in tensors)
