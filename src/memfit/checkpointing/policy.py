"""What selective checkpointing keeps.

Shared by a block's own checkpoint (:mod:`memfit.checkpointing.recompute`) and by callers that run
``torch.utils.checkpoint`` themselves (:func:`memfit.checkpointing.checkpoint_contexts`).

Example:
    >>> import torch
    >>> selective_saves(torch.ops.aten.mm.default), selective_saves(torch.ops.aten.relu.default)
    (True, False)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import checkpoint as _ckpt

from memfit.vocab import CheckpointMode

__all__ = ["SAVE_OPS", "compiled_contexts", "selective_contexts", "selective_policy", "selective_saves"]

_aten = torch.ops.aten
# Selective checkpointing keeps the outputs of the ops whose recompute is expensive
# (matmuls, attention kernels, convolutions) and recomputes everything else. Norms,
# activations and elementwise ops are memory-bound: recomputing them costs little time but
# their outputs are as large as a matmul's. This is the policy torchtitan and the PyTorch
# SAC docs use for transformer blocks; listed by OpOverloadPacket so every overload counts.
SAVE_OPS = {
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
    SAVE_OPS.add(_aten._scaled_mm)


def selective_saves(func: Any) -> bool:
    """Whether selective checkpointing keeps the output of ``func`` (an aten op or op packet)."""
    return getattr(func, "overloadpacket", func) in SAVE_OPS


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> _ckpt.CheckpointPolicy:
    return (
        _ckpt.CheckpointPolicy.MUST_SAVE if selective_saves(func) else _ckpt.CheckpointPolicy.PREFER_RECOMPUTE
    )


def selective_contexts(allow_cache_entry_mutation: bool = False) -> tuple[Any, Any]:
    """PyTorch's selective-checkpoint (forward, recompute) contexts for :func:`selective_policy`,
    with what it keeps routed through the saved-tensor hooks in scope.

    Trade-off: a tensor selective checkpointing keeps goes through an enclosing
    ``save_on_cpu`` (the ``offload`` lever) like every other saved tensor, so it costs a
    copy to the host and back, and the device holds none of the block's activations between
    its forward and its backward. See Note [selective checkpointing and saved-tensor hooks].

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> with torch.autograd.graph.save_on_cpu():
        ...     y = _ckpt.checkpoint(m, x, use_reentrant=False, context_fn=selective_contexts)
        >>> y.sum().backward(); x.grad.shape
        torch.Size([2, 4])
    """
    # Note [selective checkpointing and saved-tensor hooks]
    # Selective checkpointing keeps the outputs it saves outside the autograd graph, so up to
    # torch 2.13 an enclosing saved_tensors_hooks (save_on_cpu, the offload lever's) never saw
    # them: an "offloaded" selective block kept its matmul outputs on the device. torch 2.14
    # added the choice (respect_saved_tensors_hooks) and warns (FutureWarning) while it is
    # unset with a hook in scope; PyTorch says the unset default becomes an error next.
    # memfit chooses True: the offload lever then offloads everything a block keeps, and a
    # user's own hooks see every tensor held for the backward, as they do without
    # checkpointing. The values are the same either way (a hook packs and unpacks them), so
    # gradients are exact; tests/test_checkpointing_hooks.py checks both. PyTorch reads the
    # choice from the caching mode itself (checkpoint's own argument reaches it only when
    # the mode is context_fn's first context, and memfit wraps it), so it is set there, where
    # this torch has it.
    caching, cached = _ckpt.create_selective_checkpoint_contexts(
        selective_policy, allow_cache_entry_mutation=allow_cache_entry_mutation
    )
    if hasattr(caching, "respect_saved_tensors_hooks"):
        caching.respect_saved_tensors_hooks = True
    return caching, cached


def compiled_contexts(mode: CheckpointMode) -> dict[str, Any]:
    """The ``context_fn`` a checkpoint traced by ``torch.compile`` gets: PyTorch's own, or none."""
    # Under torch.compile a checkpointed region becomes one higher-order op whose backward the
    # AOT partitioner builds from a functionalized graph. The compiler accepts no context_fn
    # but PyTorch's selective-checkpoint dispatch modes, and needs none of memfit's eager
    # contexts: buffer mutations (BatchNorm statistics) are applied once after the forward and
    # never recomputed (eagerly: Note [buffers a forward writes]); in-place ops are
    # functionalized, so a recompute always starts from the values the forward saw; RNG is
    # replayed by the compiler. tests/test_compile.py checks each of these against the plain
    # compiled model.
    if mode == "selective":
        return {"context_fn": selective_contexts}
    return {}
