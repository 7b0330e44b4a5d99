"""Hugging Face Transformers models: built from config objects, trained on byte tokens.

``hf:NAME`` in ``model.name`` builds a model with random weights from its config class,
never from the hub: ``NAME`` is a model type (``gpt2``, ``llama``, ``mistral``, ``bert``,
or any other ``transformers`` model type) or a hub-style name that maps to one
(``openai-community/gpt2``, ``meta-llama/Llama-3.2-1B``), sized by ``model.n_layer``,
``n_embd``, ``n_head``, ``block_size`` and ``mlp_ratio``; ``model.kwargs`` sets any other
config field. ``hf:PATH`` loads a model saved locally with ``save_pretrained``.

Trade-off: memfit checkpoints per block by wrapping each decoder/encoder layer's forward,
which lets a plan choose a mode per layer; Hugging Face's own
``model.activation_checkpointing_enable(every_n_layers=..., offload=...)`` (formerly
``gradient_checkpointing_enable()``) checkpoints every n-th layer the same way. The two must
not both run on one model (a layer would be recomputed twice), so memfit refuses to add its
own on top of an active Hugging Face one, names the call back as it was made, and says which
one is on (:func:`checkpointing_owner`).

Example (with ``transformers`` installed; the tests run it in ``.venv-extras``):
    ``model = build_hf_causal_lm("llama", n_layer=2, n_embd=64, n_head=4, block_size=128)``,
    then ``memfit.find_blocks(model)`` is ``['model.layers.0', 'model.layers.1']`` and
    ``hf_causal_loss(model, (x, y))`` its training loss. Without it:

    >>> from torch import nn
    >>> checkpointing_owner(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    'none'
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memfit.checkpointing import checkpointed_blocks
from memfit.checkpointing.hf import hf_checkpointing_active
from memfit.devices import unwrap
from memfit.errors import ConfigError
from memfit.vocab import PrecisionChoice

__all__ = [
    "build_hf_causal_lm",
    "checkpointing_owner",
    "hf_causal_loss",
    "hf_model_type",
    "prepare",
    "require_transformers",
]

#: Hub-style name prefixes and the model type whose config class builds them.
_ALIASES = {
    "gpt2": "gpt2",
    "distilgpt2": "gpt2",
    "llama": "llama",
    "tinyllama": "llama",
    "mistral": "mistral",
    "bert": "bert",
    "distilbert": "distilbert",
}

#: memfit's size fields, as Hugging Face's common config attribute names.
_SIZES = {
    "num_hidden_layers": "n_layer",
    "hidden_size": "n_embd",
    "num_attention_heads": "n_head",
    "max_position_embeddings": "block_size",
}


def require_transformers() -> Any:
    """Import ``transformers`` or raise a ConfigError that names the extra to install."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "Hugging Face models need the transformers package: pip install 'memfit[hf]'."
        ) from None
    return transformers


def hf_model_type(name: str) -> str:
    """The ``transformers`` model type for ``name`` (``openai-community/gpt2`` -> ``gpt2``)."""
    transformers = require_transformers()
    known = transformers.models.auto.configuration_auto.CONFIG_MAPPING
    short = name.rsplit("/", 1)[-1].lower()
    if short in known:
        return short
    for prefix, kind in _ALIASES.items():
        if short.startswith(prefix):
            return kind
    raise ConfigError(
        f"cannot tell which Hugging Face architecture {name!r} is; use a model type such as "
        "hf:gpt2, hf:llama, hf:mistral or hf:bert, or hf:PATH of a model saved with save_pretrained."
    )


def build_hf_causal_lm(
    name: str,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 2,
    block_size: int = 64,
    mlp_ratio: int = 4,
    vocab_size: int = 256,
    **overrides: Any,
) -> nn.Module:
    """A Hugging Face model with random weights, built from its config class (no download).

    Args:
        name: a model type or hub-style name (see :func:`hf_model_type`), or the path of a
            directory saved with ``save_pretrained`` (its weights and size are used).
        n_layer, n_embd, n_head, block_size, mlp_ratio: the size (layers, width, heads,
            context length, MLP width as a multiple of the width).
        vocab_size: token ids are bytes: 256.
        overrides: any other config field (``num_key_value_heads=1``, ``rope_theta=...``).

    Returns:
        ``AutoModelForCausalLM`` for decoders, ``AutoModelForMaskedLM`` for encoders
        (BERT-style), in training mode.
    """
    transformers = require_transformers()
    path = Path(name).expanduser()
    if path.is_dir():
        return _load_local(transformers, path, vocab_size)
    kind = hf_model_type(name)
    sizes = {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "block_size": block_size}
    fields: dict[str, Any] = {key: sizes[ours] for key, ours in _SIZES.items()}
    fields.update(intermediate_size=mlp_ratio * n_embd, vocab_size=vocab_size)
    fields.update(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    fields.update(overrides)
    try:
        config = transformers.AutoConfig.for_model(kind, **fields)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cannot build a {kind} config from model settings: {exc}.") from None
    if kind == "gpt2":
        config.n_inner = fields["intermediate_size"]
    config.use_cache = False
    auto = transformers.AutoModelForMaskedLM if _is_encoder(config) else transformers.AutoModelForCausalLM
    try:
        model = auto.from_config(config)
    except ValueError as exc:
        raise ConfigError(f"transformers cannot build {kind!r} as a language model: {exc}.") from None
    return model.train()


def _is_encoder(config: Any) -> bool:
    return not getattr(config, "is_decoder", False) and config.model_type in ("bert", "distilbert", "roberta")


def _load_local(transformers: Any, path: Path, vocab_size: int) -> nn.Module:
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        auto = transformers.AutoModelForMaskedLM if _is_encoder(config) else transformers.AutoModelForCausalLM
        # transformers 5.25 loads Hugging Face hub kernels by default (use_kernels=None), which
        # fetch code from the hub and replace layers; memfit trains the model as it was saved
        model = auto.from_pretrained(path, local_files_only=True, use_kernels=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a Hugging Face model from {str(path)!r}: {exc}.") from None
    if config.vocab_size < vocab_size:
        raise ConfigError(
            f"the model in {str(path)!r} has {config.vocab_size} tokens but memfit trains on bytes "
            f"({vocab_size}); save a model with vocab_size >= {vocab_size}."
        )
    return model.train()


def hf_causal_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of a Hugging Face model's predictions against the targets ``y``.

    For a causal LM ``y`` is ``x`` shifted by one (next-token prediction), and the model's
    own ``labels=`` loss computes it (``shift_labels=y``: the targets are shifted already),
    so the ``chunked_loss`` lever applies; an encoder (masked LM) sees ``x`` and predicts
    ``y`` at every position, from its logits.
    """
    x, y = batch
    if _takes_cache(model) and _passes_loss_kwargs(model):
        y = y.contiguous()  # transformers views it flat
        out = model(input_ids=x, labels=y, shift_labels=y, use_cache=False)
        if getattr(out, "loss", None) is not None:
            return out.loss
    logits = model(input_ids=x, use_cache=False).logits if _takes_cache(model) else model(input_ids=x).logits
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _passes_loss_kwargs(model: nn.Module) -> bool:
    """Whether the causal LM's forward hands extra keywords (``shift_labels``) to its loss."""
    inner = unwrap(model)
    get_base = getattr(inner, "get_base_model", None)  # a PeftModel passes them through
    inner = get_base() if callable(get_base) else inner
    params = inspect.signature(inner.forward).parameters.values()
    return hasattr(inner, "loss_function") and any(p.kind is p.VAR_KEYWORD for p in params)


def _takes_cache(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return bool(config is not None and not _is_encoder(config))


def checkpointing_owner(model: nn.Module) -> str:
    """Who checkpoints ``model`` now: ``"memfit"``, ``"huggingface"`` or ``"none"``.

    Example:
        >>> checkpointing_owner(nn.Linear(2, 2))
        'none'
    """
    if hf_checkpointing_active(model):
        return "huggingface"
    return "memfit" if checkpointed_blocks(model) else "none"


def prepare(
    model: nn.Module,
    args: Any,
    train_dataset: Any,
    budget: int | str | None = None,
    data_collator: Any | None = None,
    precision: PrecisionChoice = "auto",
    *,
    plan: Any | None = None,
) -> Any:
    """Plan ``model`` for the Hugging Face ``Trainer``; returns the ``TrainingArguments`` to use.

    Profiles one real batch, plans to ``budget``, checkpoints the model's blocks as planned
    (turning ``use_cache`` off) and returns ``args`` with ``bf16``/``fp16``,
    ``per_device_train_batch_size`` and ``gradient_accumulation_steps`` from the plan (the
    effective batch unchanged); given ``plan`` (a :class:`memfit.Plan` made before), it uses that
    as it is, without profiling; see :func:`memfit.integrations.hf_trainer.prepare_trainer`.
    """
    from memfit.integrations.hf_trainer import prepare_trainer

    return prepare_trainer(model, args, train_dataset, budget, data_collator, precision, plan=plan)
