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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from memfit.checkpointing.policy import selective_saves
from memfit.measuring.repeated_blocks import skipping
from memfit.precision import Precision
from memfit.step import Batch, LossFn, training_step

__all__ = ["BlockFlops", "block_flops", "count_flops", "counts", "flop_counter", "stood_in"]

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


def count_flops(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    precision: Precision,
    stand_in: Mapping[str, str] | None = None,
) -> dict[str, Counts]:
    """FlopCounterMode's counts at the forward's end (``"forward"``) and the step's
    (``"total"``), from an untracked forward and backward (the gradients are dropped after).

    Args:
        stand_in: blocks that pass their input through while counting, each mapped to the
            block whose counts it takes (:func:`memfit.measuring.repeated_blocks.stand_ins`;
            :func:`stood_in`).
    """
    # FlopCounterMode does not only observe: it decomposes the ops it has no formula for
    # (MoE routing, some activations), which changes what the step allocates (+15% on a
    # small Mixtral). So the FLOPs come from a step of their own, not the tracked one.
    stand_in = stand_in or {}
    flops: dict[str, Counts] = {}
    counter = flop_counter()
    with counter, skipping(model, list(stand_in)):
        training_step(
            model,
            batch,
            loss_fn,
            None,
            precision,
            after_forward=lambda: flops.update(forward=counts(counter)),
        )
    flops["total"] = counts(counter)
    model.zero_grad(set_to_none=True)
    root = type(model).__name__
    return {k: stood_in(v, root, stand_in) for k, v in flops.items()}


def stood_in(found: Counts, root: str, stand_in: Mapping[str, str]) -> Counts:
    """``found`` (counted while the blocks ``stand_in`` maps passed their input through) with
    each such block's counts taken from the block standing in for it: its own keys and its
    submodules', and added to every module around it and to ``Global``.

    Example:
        >>> found = {"Global": {"mm": 4}, "M": {"mm": 4}, "M.0": {"mm": 2}, "M.2": {"mm": 2}}
        >>> stood_in(found, "M", {"1": "0"})["Global"], stood_in(found, "M", {"1": "0"})["M.1"]
        ({'mm': 6}, {'mm': 2})
    """
    out = {mod: dict(ops) for mod, ops in found.items()}
    for skipped, by in stand_in.items():
        own, theirs = f"{root}.{by}", f"{root}.{skipped}"
        for mod, ops in found.items():
            if mod == own or mod.startswith(own + "."):
                out[theirs + mod[len(own) :]] = dict(ops)
        around = ["Global"] + [m for m in out if m == root or theirs.startswith(m + ".")]
        for mod in around:
            into = out.setdefault(mod, {})
            for op, n in found.get(own, {}).items():
                into[op] = into.get(op, 0) + n
    return out


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
