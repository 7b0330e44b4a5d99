"""Activation checkpointing of a model's repeated blocks, in place and reversibly.

Trade-off: a checkpointed block frees its activations after forward and recomputes them
in backward, so it saves memory at the cost of (about) one more forward of that block.
``selective`` keeps the outputs of expensive ops (matmuls, attention, convolutions) and
recomputes only cheap ones (norms, activations, elementwise), so it saves less and costs
less.

Blocks are wrapped by an instance-level ``forward`` override (see ``memfit.checkpointing.layers``), so
the module tree and the state_dict keys do not change: weights saved from a checkpointed
model load into a plain one and back.

Example:
    >>> from memfit.models.gpt import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> _ = checkpoint(model, mode="full")
    >>> checkpointed_blocks(model)
    {'blocks.0': 'full', 'blocks.1': 'full'}
    >>> _ = uncheckpoint(model)
    >>> checkpointed_blocks(model)
    {}
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.checkpointing.blocks import resolve_blocks
from memfit.checkpointing.buffers import buffer_contexts
from memfit.checkpointing.hf import (
    hf_checkpointing_call,
    hf_checkpointing_off_call,
    hf_checkpoints_calls,
    peft_not_recomputable,
    without_caches,
)
from memfit.checkpointing.layers import forward_layers, set_forward_layer
from memfit.checkpointing.policy import selective_contexts
from memfit.checkpointing.recompute import run_checkpointed
from memfit.errors import ConfigError
from memfit.vocab import CheckpointMode, normalize_mode, normalize_modes

__all__ = [
    "LAYER_TAG",
    "BlockLayer",
    "checkpoint",
    "checkpoint_contexts",
    "checkpointed_blocks",
    "refuse_double_checkpointing",
    "set_block_modes",
    "uncheckpoint",
]

_TAG = "checkpoint"
#: The forward layer (:mod:`memfit.checkpointing.layers`) that checkpointing, segments included, installs.
LAYER_TAG = _TAG

_log = logging.getLogger("memfit")
_TOLD: set[type] = set()


@dataclass(frozen=True)
class BlockLayer:
    """What a checkpointed block's forward layer holds: the block and its mode."""

    module: nn.Module
    mode: CheckpointMode


def _checkpointed_forward(inner: Callable[..., Any], layer: BlockLayer, *args: Any, **kwargs: Any) -> Any:
    module = layer.module
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)  # inference (generation): the block runs as written
    if hf_checkpoints_calls(module):
        raise ConfigError(_checkpointed_twice(module))
    args, kwargs, changed = without_caches(args, kwargs, module)
    if changed and type(module) not in _TOLD:
        _TOLD.add(type(module))
        _log.warning(
            "memfit: %s is checkpointed, so its cache is turned off while training (%s), as "
            "Hugging Face's activation checkpointing does.",
            type(module).__name__,
            ", ".join(changed),
        )
    # Note [what a recompute replays]
    # Non-reentrant checkpointing replays the RNG state (dropout masks match) and
    # records the autocast state, so the recompute runs at the forward's precision;
    # run_checkpointed makes the recompute start from what the forward started from.
    return run_checkpointed(inner, module, layer.mode, args, kwargs)


def checkpoint_contexts(module: nn.Module, mode: CheckpointMode = "full") -> tuple[Any, Any]:
    """(forward, recompute) contexts for a caller that runs ``torch.utils.checkpoint`` itself:
    selective's policy for ``selective``, and the buffers the forward writes put back after each
    recompute (see Note [buffers a forward writes]). Unlike a block's own checkpoint
    (:mod:`memfit.checkpointing.recompute`), they make no copies for in-place writes to inputs.

    Example:
        >>> from torch.utils.checkpoint import checkpoint as torch_checkpoint
        >>> norm = nn.BatchNorm1d(3)
        >>> x = torch.randn(4, 3, requires_grad=True)
        >>> y = torch_checkpoint(norm, x, use_reentrant=False, context_fn=lambda: checkpoint_contexts(norm))
        >>> y.sum().backward()
        >>> int(norm.num_batches_tracked)
        1
    """
    fwd_buffers, rec_buffers = buffer_contexts(module)
    if mode == "selective":
        fwd, rec = selective_contexts()
        return _with(fwd_buffers, fwd), _Each(rec_buffers, rec)
    return fwd_buffers, rec_buffers


@contextlib.contextmanager
def _with(outer: Any, inner: Any) -> Iterator[None]:
    with outer, inner:
        yield


class _Each:
    """Two contexts entered together, as often as the recompute runs."""

    def __init__(self, outer: Any, inner: Any) -> None:
        self.outer, self.inner = outer, inner

    def __enter__(self) -> None:
        self.outer.__enter__()
        self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            self.inner.__exit__(*exc)
        finally:
            self.outer.__exit__(*exc)


def refuse_double_checkpointing(model: nn.Module) -> None:
    """Raise if Hugging Face's own checkpointing is on (memfit does not checkpoint twice), or if
    the model's blocks cannot be recomputed as they ran (peft's prefix tuning).

    Raises:
        ConfigError: ``model.activation_checkpointing_enable()`` (or the older
            ``gradient_checkpointing_enable()``) was called on ``model``, named back as it was
            called; or it is a peft model whose method cannot run again in a recompute (prefix
            tuning, activated LoRA).
    """
    call = hf_checkpointing_call(model)
    if call:
        raise ConfigError(_double_checkpointing(call, hf_checkpointing_off_call(model)))
    why = peft_not_recomputable(model)
    if why:
        raise ConfigError(
            f"{why}, so memfit cannot checkpoint this model: train it without checkpointing "
            '(memory.checkpointing = "none"), or use LoRA, DoRA or prompt tuning, whose layers recompute.'
        )


def _checkpointed_twice(module: nn.Module) -> str:
    """The sentence for a block Hugging Face started checkpointing after memfit did."""
    # Hugging Face's GradientCheckpointingLayer checks its flag on every call and, when set,
    # runs the whole call (and so memfit's checkpointed forward) inside its own checkpoint.
    call = hf_checkpointing_call(module).split("(", 1)[0]
    what = call.split("_checkpointing", 1)[0]
    return (
        f"Hugging Face {what} checkpointing was turned on for {type(module).__name__} after memfit "
        f"checkpointed it (model.{call}(), or TrainingArguments({what}_checkpointing=True)), and the two "
        f"would recompute it twice: turn Hugging Face's off (model.{hf_checkpointing_off_call(module)}) "
        "or memfit's (memfit.uncheckpoint(model))."
    )


def _double_checkpointing(call: str, off: str) -> str:
    """The sentence that refuses to checkpoint a model Hugging Face checkpoints (``call``)."""
    what = call.split("_checkpointing", 1)[0]  # "activation" or "gradient", as the user wrote it
    offload = ", whose offload to host memory memfit's plan does not count" if "offload=True" in call else ""
    return (
        f"Hugging Face {what} checkpointing is on for this model (model.{call}){offload}, so memfit will "
        f"not checkpoint its blocks a second time: call model.{off} to let memfit choose per block, or "
        "keep Hugging Face's and do not call memfit.checkpoint / memfit.apply."
    )


def set_block_modes(model: nn.Module, modes: Mapping[str, str]) -> nn.Module:
    """Set each block's checkpointing mode (``none``, ``selective`` or ``full``).

    ``modes`` maps a qualified module name, or a class name (all its outermost modules), to a mode.
    """
    checked = normalize_modes(modes)
    resolved = {n: mode for key, mode in checked.items() for n in resolve_blocks(model, [key])}
    if any(m != "none" for m in resolved.values()):
        refuse_double_checkpointing(model)
    for name, mode in resolved.items():
        module = model.get_submodule(name)
        if mode == "none":
            set_forward_layer(module, _TAG, None)
        else:
            set_forward_layer(module, _TAG, _checkpointed_forward, BlockLayer(module, mode))
    return model


def checkpoint(
    model: nn.Module,
    blocks: str | Sequence[str] = "auto",
    mode: CheckpointMode = "full",
    every: int = 1,
) -> nn.Module:
    """Checkpoint the model's blocks in place and return the model.

    Args:
        model: the model to change in place.
        blocks: ``"auto"`` (:func:`find_blocks`), or a list of qualified module names or
            class names (``["LlamaDecoderLayer"]``: every outermost module of that class).
        mode: ``"full"`` recomputes the whole block in backward; ``"selective"`` keeps
            matmul/attention/conv outputs and recomputes the rest; ``"none"`` removes
            checkpointing from these blocks.
        every: checkpoint every k-th block (blocks 0, k, 2k, ...); the others are left
            as they are. Calling again replaces the earlier setting, never double-wraps.

    Returns:
        The same model object.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
        >>> _ = checkpoint(model, mode="full", every=2)
        >>> checkpointed_blocks(model)
        {'0': 'full', '2': 'full'}
    """
    mode = normalize_mode(mode)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ConfigError(f"every must be a positive integer, got {every!r}.")
    names = resolve_blocks(model, blocks)
    return set_block_modes(model, {n: mode for i, n in enumerate(names) if i % every == 0})


def uncheckpoint(model: nn.Module) -> nn.Module:
    """Remove all checkpointing memfit added to ``model``; the module is as it was."""
    for module in model.modules():
        set_forward_layer(module, _TAG, None)
    return model


def checkpointed_blocks(model: nn.Module) -> dict[str, CheckpointMode]:
    """The blocks memfit checkpoints now, ``{name: mode}`` (blocks in a segment: ``full``)."""
    out: dict[str, CheckpointMode] = {}
    for name, module in model.named_modules():
        layer = forward_layers(module).get(_TAG)
        if layer is not None and isinstance(layer.state, BlockLayer):
            out[name] = layer.state.mode
    return out
