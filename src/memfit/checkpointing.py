"""Activation checkpointing of a model's repeated blocks, in place and reversibly.

Trade-off: a checkpointed block frees its activations after forward and recomputes them
in backward, so it saves memory at the cost of (about) one more forward of that block.
``selective`` keeps the outputs of expensive ops (matmuls, attention, convolutions) and
recomputes only cheap ones (norms, activations, elementwise), so it saves less and costs
less.

Blocks are wrapped by an instance-level ``forward`` override (see ``memfit.forward_layers``), so
the module tree and the state_dict keys do not change: weights saved from a checkpointed
model load into a plain one and back.

Example:
    >>> from memfit.train.gpt import GPT, GPTConfig
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> find_blocks(model)
    ['blocks.0', 'blocks.1']
    >>> _ = checkpoint(model, mode="full")
    >>> checkpointed_blocks(model)
    {'blocks.0': 'full', 'blocks.1': 'full'}
    >>> _ = uncheckpoint(model)
    >>> checkpointed_blocks(model)
    {}
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from memfit.errors import ConfigError
from memfit.forward_layers import forward_layers, set_forward_layer
from memfit.vocab import CHECKPOINT_MODES

__all__ = [
    "LAYER_TAG",
    "checkpoint",
    "checkpoint_contexts",
    "checkpointed_blocks",
    "find_blocks",
    "hf_checkpointing_active",
    "refuse_double_checkpointing",
    "selective_saves",
    "set_block_modes",
    "uncheckpoint",
]

_TAG = "checkpoint"
#: The forward layer (:mod:`memfit.forward_layers`) that checkpointing, segments included, installs.
LAYER_TAG = _TAG

_aten = torch.ops.aten
# NOTE: selective checkpointing keeps the outputs of the ops whose recompute is expensive
# (matmuls, attention kernels, convolutions) and recomputes everything else. Norms,
# activations and elementwise ops are memory-bound: recomputing them costs little time but
# their outputs are as large as a matmul's. This is the policy torchtitan and the PyTorch
# SAC docs use for transformer blocks; listed by OpOverloadPacket so every overload counts.
_SAVE_OPS = {
    _aten.mm,
    _aten.addmm,
    _aten.bmm,
    _aten.baddbmm,
    _aten.convolution,
    _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_cudnn_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu,
}
if hasattr(_aten, "_scaled_mm"):
    _SAVE_OPS.add(_aten._scaled_mm)


def selective_saves(func: Any) -> bool:
    """Whether selective checkpointing keeps the output of ``func`` (an aten op or op packet)."""
    return getattr(func, "overloadpacket", func) in _SAVE_OPS


def _selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if selective_saves(func) else CheckpointPolicy.PREFER_RECOMPUTE


def _is_stage(module: nn.Module) -> bool:
    """A container whose own children repeat (a ResNet stage): its children are the blocks."""
    return isinstance(module, nn.ModuleList | nn.Sequential) and bool(_repeated(list(module.children())))


def _repeated(children: Sequence[nn.Module]) -> set[type[nn.Module]]:
    """Classes of consecutive same-class children that have parameters and are not stages."""
    return {
        type(a)
        for a, b in itertools.pairwise(children)
        if type(a) is type(b) and any(True for _ in a.parameters()) and not _is_stage(a)
    }


def find_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the model's repeated blocks, in forward order.

    The blocks are found where they are shallowest: the first ``nn.ModuleList`` or
    ``nn.Sequential`` (by depth) holding two or more consecutive children of one class with
    parameters (transformer layers, ResNet blocks). A container whose own children repeat
    is a stage, not a block, so the search goes on inside it. Every outermost module of the
    block class (or classes, when several containers tie at that depth) anywhere in the
    model is a block, so ResNet's blocks across all its stages are found.

    Args:
        model: any ``nn.Module``.

    Returns:
        Qualified module names, e.g. ``["blocks.0", "blocks.1"]``; empty if there are none.

    Example:
        >>> seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> find_blocks(seq)
        ['0', '1']
    """
    best_depth: int | None = None
    classes: set[type[nn.Module]] = set()
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        depth = 0 if name == "" else name.count(".") + 1
        if best_depth is not None and depth > best_depth:
            continue
        found = _repeated(list(module.children()))
        if not found:
            continue
        if best_depth is None or depth < best_depth:
            best_depth, classes = depth, set(found)
        else:
            classes |= found
    if not classes:
        return []
    names: list[str] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if type(module) in classes and name and not any(name.startswith(p + ".") for p in inside):
            names.append(name)
            inside.append(name)
    return names


def _resolve(model: nn.Module, blocks: str | Sequence[str]) -> list[str]:
    if blocks == "auto":
        names = find_blocks(model)
        if not names:
            raise ConfigError(
                f"found no repeated blocks in {type(model).__name__} (looked for two or more "
                "consecutive same-class modules with parameters in an nn.ModuleList or "
                "nn.Sequential); pass blocks=[...] with the qualified names to checkpoint."
            )
        return names
    if isinstance(blocks, str):
        blocks = [blocks]
    modules = dict(model.named_modules())
    missing = [b for b in blocks if b not in modules or b == ""]
    if missing:
        hints = []
        for m in missing:
            close = difflib.get_close_matches(m, [n for n in modules if n], n=1)
            hints.append(f"{m!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(
            f"no module named {', '.join(hints)} in {type(model).__name__}; "
            f"blocks found by find_blocks: {find_blocks(model) or 'none'}."
        )
    return list(blocks)


def _batchnorms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats
    ]


@contextlib.contextmanager
def _keep_running_stats(module: nn.Module, inner: Any) -> Iterator[None]:
    """Recompute context: BatchNorm running statistics are restored after the recompute.

    The forward pass already updated them once; without this the recompute in backward
    would update them a second time.
    """
    saved = [
        (
            b,
            b.running_mean.clone() if b.running_mean is not None else None,
            b.running_var.clone() if b.running_var is not None else None,
            b.num_batches_tracked.clone() if b.num_batches_tracked is not None else None,
        )
        for b in _batchnorms(module)
    ]
    try:
        with inner:
            yield
    finally:
        with torch.no_grad():
            for b, mean, var, count in saved:
                for buf, old in (
                    (b.running_mean, mean),
                    (b.running_var, var),
                    (b.num_batches_tracked, count),
                ):
                    if buf is not None and old is not None:
                        buf.copy_(old)


def _contexts(module: nn.Module, mode: str) -> tuple[Any, Any]:
    if mode == "selective":
        fwd, rec = create_selective_checkpoint_contexts(_selective_policy)
    else:
        fwd, rec = contextlib.nullcontext(), contextlib.nullcontext()
    return fwd, _keep_running_stats(module, rec)


def checkpoint_contexts(module: nn.Module, mode: str = "full") -> tuple[Any, Any]:
    """The (forward, recompute) contexts of memfit's checkpoint of ``module``: selective's
    policy for ``selective``, BatchNorm running statistics kept through the recompute."""
    return _contexts(module, mode)


def _checkpointed_forward(
    inner: Callable[..., Any], module: nn.Module, mode: str, *args: Any, **kwargs: Any
) -> Any:
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    # NOTE: non-reentrant checkpointing replays the RNG state (dropout masks match) and
    # records the autocast state, so the recompute runs at the forward's precision.
    return _torch_checkpoint(
        inner,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=functools.partial(_contexts, module, mode),
        **kwargs,
    )


def hf_checkpointing_active(model: nn.Module) -> bool:
    """Whether Hugging Face's ``gradient_checkpointing_enable()`` is on for ``model``.

    # NOTE: here, not in memfit.integrations.hf, so that checkpointing imports nothing above it.
    """
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        value = getattr(type(model), attr, None)
        if isinstance(value, property):
            return bool(getattr(model, attr))
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def refuse_double_checkpointing(model: nn.Module) -> None:
    """Raise if Hugging Face's own checkpointing is on: memfit does not checkpoint twice.

    Raises:
        ConfigError: ``model.gradient_checkpointing_enable()`` was called on ``model``.
    """
    if hf_checkpointing_active(model):
        raise ConfigError(
            "Hugging Face gradient checkpointing is on for this model (gradient_checkpointing_enable()), "
            "so memfit will not checkpoint its blocks a second time: call "
            "model.gradient_checkpointing_disable() to let memfit choose per block, or keep "
            "Hugging Face's and do not call memfit.checkpoint / memfit.apply."
        )


def set_block_modes(model: nn.Module, modes: Mapping[str, str]) -> nn.Module:
    """Set each named block's checkpointing mode (``none``, ``selective`` or ``full``)."""
    names = _resolve(model, list(modes))
    bad = {n: m for n, m in modes.items() if m not in CHECKPOINT_MODES}
    if bad:
        raise ConfigError(f"unknown checkpointing mode(s) {bad}; use one of {', '.join(CHECKPOINT_MODES)}.")
    if any(m != "none" for m in modes.values()):
        refuse_double_checkpointing(model)
    for name in names:
        module = model.get_submodule(name)
        mode = modes[name]
        if mode == "none":
            set_forward_layer(module, _TAG, None)
        else:
            set_forward_layer(module, _TAG, _checkpointed_forward, module, mode)
    return model


def checkpoint(
    model: nn.Module,
    blocks: str | Sequence[str] = "auto",
    mode: str = "full",
    every: int = 1,
) -> nn.Module:
    """Checkpoint the model's blocks in place and return the model.

    Args:
        model: the model to change in place.
        blocks: ``"auto"`` (:func:`find_blocks`) or a list of qualified module names.
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
    if mode not in CHECKPOINT_MODES:
        raise ConfigError(f"unknown checkpointing mode {mode!r}; use one of {', '.join(CHECKPOINT_MODES)}.")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ConfigError(f"every must be a positive integer, got {every!r}.")
    names = _resolve(model, blocks)
    return set_block_modes(model, {n: mode for i, n in enumerate(names) if i % every == 0})


def uncheckpoint(model: nn.Module) -> nn.Module:
    """Remove all checkpointing memfit added to ``model``; the module is as it was."""
    for module in model.modules():
        set_forward_layer(module, _TAG, None)
    return model


def checkpointed_blocks(model: nn.Module) -> dict[str, str]:
    """The blocks memfit checkpoints now, ``{name: mode}``."""
    out = {}
    for name, module in model.named_modules():
        layer = forward_layers(module).get(_TAG)
        if layer is not None:
            out[name] = layer[1][1]
    return out
