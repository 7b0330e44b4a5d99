"""What selective checkpointing keeps, and BatchNorm statistics across a recompute.

Shared by a block's own checkpoint (:mod:`memfit.checkpointing.recompute`) and by callers that run
``torch.utils.checkpoint`` themselves (:func:`memfit.checkpointing.checkpoint_contexts`).

Example:
    >>> import torch
    >>> selective_saves(torch.ops.aten.mm.default), selective_saves(torch.ops.aten.relu.default)
    (True, False)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as _ckpt

from memfit.vocab import CheckpointMode

__all__ = ["SAVE_OPS", "compiled_contexts", "keep_running_stats", "selective_policy", "selective_saves"]

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


def compiled_contexts(mode: CheckpointMode) -> dict[str, Any]:
    """The ``context_fn`` a checkpoint traced by ``torch.compile`` gets: PyTorch's own, or none."""
    # Under torch.compile a checkpointed region becomes one higher-order op whose backward the
    # AOT partitioner builds from a functionalized graph. The compiler accepts no context_fn
    # but PyTorch's selective-checkpoint dispatch modes, and needs none of memfit's eager
    # contexts: buffer mutations (BatchNorm statistics) are applied once after the forward and
    # never recomputed; in-place ops are functionalized, so a recompute always starts from the
    # values the forward saw; RNG is replayed by the compiler. tests/test_compile.py checks
    # each of these against the plain compiled model.
    if mode == "selective":
        return {"context_fn": functools.partial(_ckpt.create_selective_checkpoint_contexts, selective_policy)}
    return {}


@contextlib.contextmanager
def keep_running_stats(module: nn.Module) -> Iterator[None]:
    """BatchNorm running statistics are put back after the recompute, which updated them again."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    saved = [(buf, buf.clone()) for m in norms for buf in m.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, old in saved:
                buf.copy_(old)
