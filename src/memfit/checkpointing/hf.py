"""Facts about third-party model objects, found without importing their libraries.

Checkpointing must know a few things about Hugging Face models: whether their own activation
checkpointing is on (and how it was turned on, to name it back), which of a block's
arguments are caches that a forward pass appends to, and which classes Hugging Face itself
checkpoints. They are read here from class names and attributes, so ``memfit.checkpointing``
depends on nothing in ``memfit.integrations`` (which builds on this module, one way) and
works whether or not ``transformers`` is installed.

Example:
    >>> from torch import nn
    >>> hf_checkpointing_active(nn.Linear(2, 2)), hf_checkpointing_call(nn.Linear(2, 2))
    (False, '')
    >>> without_caches((1,), {"use_cache": True, "past_key_values": object()})
    ((1,), {'use_cache': False, 'past_key_values': None}, ['use_cache', 'past_key_values'])
    >>> class Layer(nn.Module):
    ...     def forward(self, h, position, use_cache=False, cache=None):
    ...         return h
    >>> without_caches((1, 0, True, object()), {}, Layer())[0]
    (1, 0, False, None)
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

from torch import nn

__all__ = [
    "hf_block_classes",
    "hf_checkpointing_active",
    "hf_checkpointing_call",
    "hf_checkpointing_off_call",
    "hf_checkpoints_calls",
    "is_hf_cache",
    "peft_not_recomputable",
    "without_caches",
]

#: Keyword arguments through which Hugging Face blocks receive a cache they append to
#: (decoders' key/value caches; ``cache_params`` is the state-space models' cache).
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past", "cache_params")


def _from_transformers(cls: type, name: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith("transformers.") for c in cls.__mro__)


def is_hf_cache(obj: Any) -> bool:
    """Whether ``obj`` is a Hugging Face cache (``transformers.cache_utils.Cache`` or a subclass)."""
    return _from_transformers(type(obj), "Cache")


_NAMES: dict[type, tuple[str, ...]] = {}


def _positional_names(cls: type[nn.Module]) -> tuple[str, ...]:
    """The names ``cls.forward`` gives its positional arguments (after ``self``), read once per class."""
    if cls not in _NAMES:
        try:
            params = list(inspect.signature(cls.forward).parameters.values())[1:]
        except (TypeError, ValueError):  # a builtin or C forward: nothing to read
            params = []
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        _NAMES[cls] = tuple(p.name for p in params if p.kind in kinds)
    return _NAMES[cls]


def _off(name: str, value: Any) -> Any:
    """``value`` with the cache turned off, if ``name`` is a cache flag or a cache argument."""
    if name == "use_cache" and value is True:
        return False
    if name in _CACHE_KWARGS and value is not None:
        return None
    return value


def without_caches(
    args: tuple[Any, ...], kwargs: dict[str, Any], module: nn.Module | None = None
) -> tuple[tuple[Any, ...], dict[str, Any], list[str]]:
    """A block call's arguments with its caches turned off, and the names of what was changed.

    With ``module``, arguments passed by position are read by the names its ``forward``
    gives them (RecurrentGemma's layers take ``use_cache`` and the cache by position).
    """
    # Note [caches off in a recompute]
    # A Hugging Face decoder block appends this step's keys and values to the cache it is
    # given. Recomputed in backward, it would append them a second time (the cache doubles,
    # and the recompute attends to it: different results, or shape errors). Hugging Face's
    # own ``GradientCheckpointingLayer`` passes ``use_cache=False`` and no cache to a
    # checkpointed layer while training; memfit does the same. Training never reads the cache.
    changed: list[str] = []
    out = dict(kwargs)
    if out.get("use_cache") is True:
        out["use_cache"] = False
        changed.append("use_cache")
    for key in _CACHE_KWARGS:
        if out.get(key) is not None:
            out[key] = None
            changed.append(key)
    names = _positional_names(type(module)) if module is not None else ()
    new_args = tuple(_off(names[i], a) if i < len(names) else a for i, a in enumerate(args))
    changed += [names[i] for i, (a, b) in enumerate(zip(args, new_args, strict=True)) if a is not b]
    cleared = tuple(None if is_hf_cache(a) else a for a in new_args)
    if any(a is not b for a, b in zip(new_args, cleared, strict=True)):
        changed.append("cache argument")
    return cleared, out, changed


def hf_checkpointing_active(model: nn.Module) -> bool:
    """Whether Hugging Face's own checkpointing (``activation_checkpointing_enable()``, formerly
    ``gradient_checkpointing_enable()``) is on for ``model``."""
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        value = getattr(type(model), attr, None)
        if isinstance(value, property):
            return bool(getattr(model, attr))
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _new_spelling() -> bool:
    """Whether the ``transformers`` in use spells it ``activation_checkpointing`` (5.24 and newer; its
    ``gradient_checkpointing*`` names are deprecated aliases, removed in v6). Not imported here: a
    Hugging Face model means it is imported already."""
    modeling = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling, "PreTrainedModel", None)
    return base is None or hasattr(base, "activation_checkpointing_enable")


def _hf_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if _from_transformers(type(m), "GradientCheckpointingLayer")]


def _offloads(func: Any) -> bool:
    """Whether Hugging Face's checkpoint function ``func`` runs under ``save_on_cpu`` (``offload=True``)."""
    inner = func.func if isinstance(func, functools.partial) else func
    return "save_on_cpu" in getattr(getattr(inner, "__code__", None), "co_names", ())


def _every_n_layers(flags: list[bool]) -> int:
    """The ``every_n_layers`` that checkpoints the layers ``flags`` marks (layer 0, n, 2n, ...)."""
    on = [i for i, flag in enumerate(flags) if flag]
    if len(on) >= 2:
        return on[1] - on[0]
    return len(flags) if len(on) == 1 and len(flags) > 1 else 1


def hf_checkpointing_call(model: nn.Module) -> str:
    """The call that turned Hugging Face's own checkpointing on for ``model``, as its
    ``transformers`` spells it, or ``""`` when it is off.

    transformers 5.24 and newer: ``activation_checkpointing_enable()``, with ``every_n_layers=``
    and ``offload=True`` when they were given (read off the layers); older releases:
    ``gradient_checkpointing_enable()``.

    Example:
        >>> hf_checkpointing_call(nn.Linear(2, 2))
        ''
    """
    if not hf_checkpointing_active(model):
        return ""
    if not _new_spelling():
        return "gradient_checkpointing_enable()"
    layers = _hf_layers(model)
    flags = [getattr(m, "gradient_checkpointing", False) is True for m in layers]
    given = []
    if _every_n_layers(flags) > 1:
        given.append(f"every_n_layers={_every_n_layers(flags)}")
    if any(_offloads(getattr(m, "_gradient_checkpointing_func", None)) for m in model.modules()):
        given.append("offload=True")
    return f"activation_checkpointing_enable({', '.join(given)})"


def hf_checkpointing_off_call(model: nn.Module) -> str:
    """The call that turns Hugging Face's own checkpointing off, as the installed ``transformers``
    spells it (``model`` is the model it is said of).

    Example:
        >>> hf_checkpointing_off_call(nn.Linear(2, 2))
        'activation_checkpointing_disable()'
    """
    return "activation_checkpointing_disable()" if _new_spelling() else "gradient_checkpointing_disable()"


def hf_checkpoints_calls(module: nn.Module) -> bool:
    """Whether Hugging Face checkpoints each call of ``module`` itself now: a
    ``GradientCheckpointingLayer`` whose flag is on, in training.

    Example:
        >>> hf_checkpoints_calls(nn.Linear(2, 2))
        False
    """
    return (
        getattr(module, "gradient_checkpointing", False) is True
        and module.training
        and _from_transformers(type(module), "GradientCheckpointingLayer")
    )


def hf_block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """Classes in ``model`` that Hugging Face checkpoints itself (``GradientCheckpointingLayer``)."""
    return {type(m) for m in _hf_layers(model)}


#: peft methods whose trained prefix reaches every layer through the cache (``past_key_values``).
_THROUGH_THE_CACHE = ("PREFIX_TUNING", "CARTRIDGE")


def peft_not_recomputable(model: nn.Module) -> str:
    """Why the peft method on ``model`` cannot run again in a checkpointed layer's recompute, or ``""``.

    A checkpointed layer runs with its cache turned off (see :func:`without_caches`), so a
    prefix handed over in the cache would not reach it (peft's prefix tuning); and a
    recompute runs after the model's forward has returned, when hooks that peft registers
    only for that forward are gone (activated LoRA's offsets, peft issue 2826).

    Example:
        >>> peft_not_recomputable(nn.Linear(2, 2))
        ''
    """
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return ""
    for config in configs.values():
        kind = str(getattr(getattr(config, "peft_type", None), "value", ""))
        if kind in _THROUGH_THE_CACHE:
            name = kind.lower().replace("_", " ")
            return (
                f"peft's {name} hands every layer its prefix through the model's cache, which a checkpointed "
                "layer runs without"
            )
        if getattr(config, "alora_invocation_tokens", None):
            return (
                "peft's activated LoRA (alora_invocation_tokens) hands each adapter its offsets through "
                "hooks that exist only while the model's forward runs, not while a checkpointed layer "
                "recomputes"
            )
    return ""
