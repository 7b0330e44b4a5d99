"""The order blocks run in, and a plain step's numbers put in that order.

:func:`memfit.find_blocks` lists blocks in module order; the step runs them in the order
the model's ``forward`` calls them. They differ where the blocks are not one chain:
CLIP's ``CLIPModel`` defines its text tower before its vision tower and runs the vision
tower first. The step model (:mod:`memfit.stepmodel.memory`) walks blocks in list order,
each block's forward holding what the blocks before it kept and the backward running in
reverse, so a profile lists its blocks in the order they ran.
See Note [blocks in the order they ran].

Example:
    >>> from torch import nn
    >>> class Towers(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)
    ...     def forward(self, x):
    ...         return self.a(x) + self.b(x).sum()
    >>> class Swapped(Towers):
    ...     def forward(self, x):
    ...         return self.b(x) + self.a(x).sum()
    >>> import torch
    >>> model = Swapped()
    >>> with run_order(model, ["a", "b"]) as seen:
    ...     _ = model(torch.ones(1, 2))
    >>> seen
    ['b', 'a']
    >>> reordered_links(["a", "b", "c"], [True, False], ["c", "a", "b"])
    [False, True]
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from memfit.measuring.phases import StepMemory
from memfit.records import BlockStats

__all__ = [
    "between_blocks",
    "in_run_order",
    "put_in_run_order",
    "reorder_memory",
    "reordered_links",
    "run_order",
]

# Note [blocks in the order they ran]
# A profile's blocks are in the order their forwards first ran in the plain step (module
# order where that is the same, or where some block did not run). The backward is taken
# to run in reverse: PyTorch's engine runs the ready node created last first, so two
# towers joined at the loss are backwarded last tower first. Chain links (where segments
# may go) hold only between blocks that are neighbours in both orders.


@contextlib.contextmanager
def run_order(model: nn.Module, blocks: Sequence[str]) -> Iterator[list[str]]:
    """Record, in the forward run inside, the order in which ``blocks`` are first called."""
    seen: list[str] = []
    handles = []
    for name in blocks:

        def hook(module: nn.Module, args: Any, name: str = name) -> None:
            if name not in seen:
                seen.append(name)

        handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def in_run_order(blocks: Sequence[str], seen: Sequence[str]) -> list[str]:
    """``blocks`` in the order ``seen`` ran them, or as they are where some block did not run."""
    if len(seen) != len(blocks) or set(seen) != set(blocks):
        return list(blocks)
    return list(seen)


def reordered_links(blocks: Sequence[str], links: Sequence[bool], order: Sequence[str]) -> list[bool]:
    """Chain links of ``blocks`` (``links[k]``: block k+1 took block k's output) for ``order``
    (none where ``links`` is empty)."""
    linked = {(a, b) for a, b, ok in zip(blocks, blocks[1:], links, strict=False) if ok}
    return [pair in linked for pair in itertools.pairwise(order)]


def reorder_memory(mem: StepMemory, order: Sequence[str]) -> None:
    """Put a step's per-block numbers in ``order`` (the gradients at the first backward follow)."""
    by_name = {b.name: b for b in mem.blocks}
    if set(by_name) != set(order) or [b.name for b in mem.blocks] == list(order):
        return
    mem.blocks = [by_name[n] for n in order]
    mem.early_grads = mem.blocks[-1].backward_grads if mem.blocks else 0


def put_in_run_order(
    blocks: Sequence[str],
    seen: Sequence[str],
    mem: StepMemory,
    links: Sequence[bool],
    keeps_shape: Sequence[bool],
) -> tuple[list[str], list[bool], list[bool]]:
    """The blocks in the order they ran, and their chain links and residual flags in that order;
    ``mem`` (the step ``seen`` watched) is reordered in place."""
    order = in_run_order(blocks, seen)
    reorder_memory(mem, order)
    keeps = dict(zip(blocks, keeps_shape, strict=True))
    return order, reordered_links(blocks, links, order), [keeps[b] for b in order]


def between_blocks(mem: StepMemory, blocks: Sequence[BlockStats]) -> None:
    """Fill each block's ``after_held_bytes`` and ``after_grad_bytes`` from the plain step ``mem``.

    Where the code outside the blocks runs between two of them (GoogLeNet's auxiliary heads,
    CLIP's step from one tower to the next), what it holds then and the gradients its backward
    creates are the step's too. Each is what the step's totals grew by between the two blocks
    (never below 0). See Note [outside between blocks].
    """
    ran = {b.name: b for b in mem.blocks}
    for st, nxt in itertools.pairwise(blocks):
        here, there = ran.get(st.name), ran.get(nxt.name)
        if here is None or there is None:
            continue
        st.after_held_bytes = max(0, there.forward_start - here.forward_end)
        st.after_grad_bytes = max(0, here.backward_grads - there.backward_grads - nxt.grad_bytes)


# Note [outside between blocks]
# The step model's outside runs before the first block (stem) and after the last (head,
# loss). Code that runs between two blocks holds its bytes while every later block's
# forward runs (after_held_bytes) and creates its parameters' gradients in its backward,
# before the earlier block's backward (after_grad_bytes): the events add both from then
# on. What it keeps for its backward is in the outside's kept bytes, and each block's
# backward peak is measured against them, so the events need nothing more for it.
