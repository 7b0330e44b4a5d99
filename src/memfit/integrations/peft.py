"""Adapters made with peft (LoRA, DoRA): what ``memfit train`` builds from a config's ``[model.lora]``.

memfit plans, checkpoints and trains a ``peft.PeftModel`` as it is (docs/lora.md): its
blocks are found under the wrapped names, checkpointing is non-reentrant (so no
``enable_input_require_grads``), and the frozen base gets no gradient or optimizer state.
This module only builds adapters from settings and says, in one sentence, what is missing
when peft is not installed or a model cannot take them.

Trade-off: peft injects its layers into the base model in place; :func:`add_adapters`
checks what it can before peft touches the model (the method, that the targets exist), so
those refusals leave the model as it was.

Example (with ``peft`` installed; the tests run it in ``.venv-extras``):
    ``model = add_adapters(build_hf_causal_lm("llama"), rank=8, target_modules=["q_proj", "v_proj"])``
    trains only ``lora_A`` / ``lora_B``. A target the model lacks is refused before peft
    touches it:

    >>> from torch import nn
    >>> try:
    ...     add_adapters(nn.Sequential(nn.Linear(2, 2)), rank=2, target_modules=["q_proj"])
    ... except ConfigError as exc:
    ...     print(str(exc).split(";")[0])
    the model has no module named 'q_proj' to put adapters on
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from memfit.errors import ConfigError

__all__ = ["ADAPTER_METHODS", "add_adapters", "require_peft"]

#: The adapter methods :func:`add_adapters` builds (DoRA: peft's weight-decomposed LoRA).
ADAPTER_METHODS = ("lora", "dora")


def require_peft() -> Any:
    """Import ``peft`` or raise a ConfigError that names the extra to install."""
    try:
        import peft
    except ImportError:
        raise ConfigError("LoRA adapters need the peft package: pip install 'memfit[peft]'.") from None
    return peft


def _missing_targets(model: nn.Module, targets: Sequence[str]) -> list[str]:
    names = [n for n, _ in model.named_modules()]
    return [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]


def add_adapters(
    model: nn.Module,
    *,
    rank: int,
    alpha: float = 16.0,
    dropout: float = 0.0,
    target_modules: Sequence[str] = (),
    method: str = "lora",
) -> nn.Module:
    """Wrap ``model`` with trainable adapters (``peft.get_peft_model``); its own weights freeze.

    Args:
        model: the base model (a Hugging Face model, or any model whose targets are ``nn.Linear``).
        rank: the LoRA rank r (at least 1).
        alpha: the LoRA scaling (updates are scaled by ``alpha / rank``).
        dropout: dropout on the adapters' input (the recompute replays its masks).
        target_modules: module names (or name suffixes) to adapt; empty: peft's default for
            the architecture (e.g. ``q_proj``, ``v_proj`` for Llama).
        method: ``"lora"`` or ``"dora"``.

    Returns:
        The ``peft.PeftModel``.

    Raises:
        ConfigError: peft is not installed, a target is not a module of the model, or peft
            cannot adapt the model (one sentence naming the setting that fixes it).
    """
    if method not in ADAPTER_METHODS:
        raise ConfigError(f"adapter method {method!r} is not one of {', '.join(ADAPTER_METHODS)}.")
    missing = _missing_targets(model, target_modules)
    if missing:
        raise ConfigError(
            f"the model has no module named {missing[0]!r} to put adapters on; set lora.target_modules to "
            f"names of its Linear layers (such as {_linear_examples(model)})."
        )
    peft = require_peft()
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules) or None,
        use_dora=method == "dora",
    )
    try:
        return peft.get_peft_model(model, config)
    except (ValueError, TypeError) as exc:
        reason = str(exc).split("\n")[0].rstrip(".")
        raise ConfigError(
            f"peft cannot put {method} adapters on {type(model).__name__} ({reason}); set "
            f"lora.target_modules to names of its Linear layers (such as {_linear_examples(model)})."
        ) from None


def _linear_examples(model: nn.Module) -> str:
    names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and n})
    return ", ".join(repr(n) for n in names[:4]) or "none found"
