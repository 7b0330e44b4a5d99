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

from memfit.app.config import FROZEN_BASES, Config, LoraConfig, ModelConfig
from memfit.errors import ConfigError
from memfit.levers.frozen import cast_frozen, is_nf4, nf4_available, nf4_linears, quantize_frozen
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.models.spec import ModelSpec
from memfit.vocab import PrecisionChoice

__all__ = ["base_refusal", "build_model", "load_factory", "run_precision", "store_frozen_base"]


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


def base_refusal(lora: LoraConfig) -> str | None:
    """Why ``model.lora.base`` cannot be stored on this machine (a sentence naming the fix), or None.

    Example:
        >>> base_refusal(LoraConfig(rank=8, base="bf16")) is None
        True
    """
    if lora.rank > 0 and "frozen_nf4" in FROZEN_BASES.get(lora.base, ()) and not nf4_available():
        return (
            f"model.lora.base = {lora.base!r} stores the frozen base in NF4 through torchao's NF4Tensor, and "
            'torchao is not installed: `pip install torchao` adds it, or set model.lora.base = "bf16".'
        )
    return None


def store_frozen_base(model: nn.Module, lora: LoraConfig) -> str:
    """Store the frozen base of an adapted ``model`` as ``lora.base`` says, in place (before its
    optimizer is built); returns how it is stored, for the run's report.

    See Note [the frozen base's storage]. A model without adapters (rank 0) is left as built.

    Raises:
        ConfigError: the base needs torchao, which is not installed (:func:`base_refusal`), or
            ``"nf4"`` finds no weight to quantize; nothing is changed.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(4, 4).requires_grad_(False)
        >>> store_frozen_base(lin, LoraConfig(rank=8, base="bf16"))
        'bf16 (20 frozen values in bf16, no fp32 copy)'
        >>> lin.weight.dtype
        torch.bfloat16
    """
    if lora.rank == 0 or not FROZEN_BASES.get(lora.base):
        return "fp32 (as built)"
    why = base_refusal(lora)
    if why is not None:
        raise ConfigError(why)
    if lora.base == "nf4" and not nf4_linears(model):
        raise ConfigError(
            "model.lora.base = 'nf4' quantizes frozen nn.Linear weights (not the output head) whose size "
            '64 x 256 divides, and this model has none; set model.lora.base = "bf16".'
        )
    if "frozen_nf4" in FROZEN_BASES[lora.base]:  # the NF4 weights first, then the rest in bf16
        quantize_frozen(model)
    if "frozen_bf16" in FROZEN_BASES[lora.base]:
        cast_frozen(model)
    seen: dict[int, nn.Parameter] = {id(p): p for p in model.parameters() if not p.requires_grad}
    nf4 = sum(p.numel() for p in seen.values() if is_nf4(p))
    rest = sum(p.numel() for p in seen.values() if not is_nf4(p) and p.is_floating_point())
    if lora.base == "bf16":
        return f"bf16 ({rest:,} frozen values in bf16, no fp32 copy)"
    return f"nf4 ({nf4:,} frozen Linear values in NF4 through torchao, the other {rest:,} in bf16)"


def run_precision(cfg: Config) -> PrecisionChoice:
    """``memory.precision``, with ``"auto"`` made ``"bf16"`` for a bf16 or NF4 frozen base (which
    computes in bf16: See Note [the frozen base's storage]).

    Example:
        >>> from memfit.app.config import load_config
        >>> run_precision(load_config(None, ["model.name='hf:llama'", "model.lora.rank=4",
        ...                                  "model.lora.base='bf16'"]))
        'bf16'
    """
    lora = cfg.model.lora
    if lora.rank > 0 and FROZEN_BASES.get(lora.base) and cfg.memory.precision == "auto":
        return "bf16"
    return cfg.memory.precision


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
