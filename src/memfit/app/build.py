"""Build what a run needs from its config: the model, its loss function and batches.

A model is the built-in GPT, a Hugging Face architecture built from its config
(``hf:gpt2``, ``hf:llama``, ``hf:PATH``; see :mod:`memfit.integrations.hf`) or
``import:package.module:factory``. The factory is called
with ``model.kwargs`` and returns either an ``nn.Module`` that maps ``(B, T)`` byte tokens
to ``(B, T, V)`` logits (it then trains on the text corpus like the GPT), or a
:class:`~memfit.models.spec.ModelSpec` that brings its own loss function and batches.
``[model.lora]`` wraps any of them with peft adapters (docs/lora.md).

Example:
    >>> from memfit.app.config import load_config
    >>> spec = build_model(load_config(None, ["model.n_layer=1", "model.n_embd=16",
    ...                                       "model.n_head=2", "model.block_size=8"]).model)
    >>> x, y = spec.random_batch(2, seed=0)
    >>> spec.loss_fn(spec.model, (x, y)).ndim
    0
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from memfit.app.config import ModelConfig
from memfit.errors import ConfigError
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.models.spec import ModelSpec

__all__ = ["build_model", "load_factory"]


def load_factory(target: str) -> Callable[..., Any]:
    """Import ``package.module:factory``; a clear ConfigError if that fails."""
    module_name, colon, attr = target.partition(":")
    if not colon or not module_name or not attr:
        raise ConfigError(f"model factory {target!r} must look like 'package.module:factory'.")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"cannot import module {module_name!r} for the model factory: {exc}.") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"module {module_name!r} has no callable {attr!r} to build the model.")
    return factory


def build_model(cfg: ModelConfig) -> ModelSpec:
    """Build a fresh model from its config (the caller seeds torch first), with the adapters of
    ``[model.lora]`` when its rank is set (:func:`memfit.integrations.peft.add_adapters`)."""
    spec = _base_model(cfg)
    lora = cfg.lora
    if lora.rank > 0:
        from memfit.integrations.peft import add_adapters

        spec.model = add_adapters(
            spec.model,
            rank=lora.rank,
            alpha=lora.alpha,
            dropout=lora.dropout,
            target_modules=lora.target_modules,
            method=lora.method,
        )
    return spec


def _base_model(cfg: ModelConfig) -> ModelSpec:
    if cfg.name == "gpt":
        try:
            gcfg = GPTConfig(
                n_layer=cfg.n_layer,
                n_embd=cfg.n_embd,
                n_head=cfg.n_head,
                block_size=cfg.block_size,
                dropout=cfg.dropout,
                mlp_ratio=cfg.mlp_ratio,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return ModelSpec(model=GPT(gcfg), loss_fn=gpt_loss, seq_len=cfg.block_size)
    if cfg.name.startswith("import:"):
        factory = load_factory(cfg.name[len("import:") :])
        try:
            built = factory(**cfg.kwargs)
        except TypeError as exc:
            raise ConfigError(f"model factory {cfg.name!r} rejected model.kwargs: {exc}.") from None
        if isinstance(built, ModelSpec):
            return built
        if isinstance(built, nn.Module):
            return ModelSpec(model=built, loss_fn=gpt_loss, seq_len=cfg.block_size)
        raise ConfigError(
            f"model factory {cfg.name!r} returned {type(built).__name__}; it must return an "
            "nn.Module or a memfit ModelSpec."
        )
    if cfg.name.startswith("hf:"):
        from memfit.integrations.hf import build_hf_causal_lm, hf_causal_loss

        model = build_hf_causal_lm(
            cfg.name[len("hf:") :],
            n_layer=cfg.n_layer,
            n_embd=cfg.n_embd,
            n_head=cfg.n_head,
            block_size=cfg.block_size,
            mlp_ratio=cfg.mlp_ratio,
            **cfg.kwargs,
        )
        return ModelSpec(model=model, loss_fn=hf_causal_loss, seq_len=cfg.block_size)
    raise ConfigError(f"model.name {cfg.name!r} is not supported here; use 'gpt', 'hf:NAME' or 'import:...'.")
