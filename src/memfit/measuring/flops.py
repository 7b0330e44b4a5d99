"""FLOPs per block, counted by ``FlopCounterMode``, split the ways the step model needs them.

The step model (:mod:`memfit.stepmodel`) prices recompute by work: a fully checkpointed
block recomputes its whole forward, a selectively checkpointed one only the ops whose
outputs selective checkpointing does not keep. :func:`flop_counter` is PyTorch's
``FlopCounterMode`` with the formula it lacks for the CPU flash-attention kernel (the one
it already uses for the CUDA kernels), and :func:`block_flops` splits its per-module counts
into forward, backward and selective-recompute FLOPs per block.

Trade-off: FlopCounterMode counts only ops it has a formula for (matmuls, convolutions,
attention); elementwise ops count 0 FLOPs, and the step model prices them by the bytes
they write instead (:class:`memfit.records.BlockStats` ``forward_bytes``).

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    >>> counter = flop_counter()
    >>> with counter:
    ...     _ = model(torch.randn(4, 8))
    >>> block_flops(counts(counter), counts(counter), "Sequential", ["0", "1"])["0"].forward
    512
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from memfit.checkpointing.policy import selective_saves

__all__ = ["BlockFlops", "block_flops", "counts", "flop_counter"]

_aten = torch.ops.aten

#: FLOP counts per module name (``<RootClass>.<qualified name>``, ``Global``) and op.
Counts = dict[str, dict[Any, int]]


def _cpu_flash(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query, key, value))


def _cpu_flash_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad_out, query, key, value))


def flop_counter() -> FlopCounterMode:
    """``FlopCounterMode(display=False)`` that also counts the CPU flash-attention kernel."""
    # Without these the CPU's attention counts 0 FLOPs, and a long sequence's attention (a
    # large part of the forward) would look free to recompute.
    mapping = {
        _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
        _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
    }
    return FlopCounterMode(display=False, custom_mapping=mapping)


def counts(counter: FlopCounterMode) -> Counts:
    """A copy of the counter's per-module, per-op counts (take one when the forward ends)."""
    return {mod: dict(ops) for mod, ops in counter.flop_counts.items()}


@dataclass
class BlockFlops:
    """One part's FLOPs in a step without checkpointing."""

    forward: int = 0
    backward: int = 0
    selective_recompute: int = 0
    """Forward FLOPs of the ops selective checkpointing recomputes (it keeps the others)."""


def block_flops(forward: Counts, total: Counts, root: str, names: Sequence[str]) -> dict[str, BlockFlops]:
    """Per block (and ``"outside"``): forward, backward and selective-recompute FLOPs.

    Args:
        forward: counts when the forward ended; total: counts when the step ended.
        root: the model's class name (the counter's prefix); names: the blocks.
    """
    out: dict[str, BlockFlops] = {}
    for name in names:
        fwd = forward.get(f"{root}.{name}", {})
        tot = sum(total.get(f"{root}.{name}", {}).values())
        f = sum(fwd.values())
        sel = sum(v for op, v in fwd.items() if not selective_saves(op))
        out[name] = BlockFlops(forward=f, backward=max(0, tot - f), selective_recompute=sel)
    f_all = sum(forward.get("Global", {}).values())
    t_all = sum(total.get("Global", {}).values())
    f_blocks = sum(b.forward for b in out.values())
    b_blocks = sum(b.backward for b in out.values())
    out["outside"] = BlockFlops(forward=max(0, f_all - f_blocks), backward=max(0, t_all - f_all - b_blocks))
    return out
