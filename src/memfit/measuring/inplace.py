"""What the profile says about in-place writes in checkpointed blocks, and how a plan reads it.

A checkpointed block that writes in place into its input, or into an output selective
checkpointing keeps, is still recomputed exactly: :mod:`memfit.checkpointing.recompute` copies what is
about to be overwritten. The copy costs memory, which the profile's numbers include; the
profile also says which blocks make such writes, under which modes, so a plan that uses
those modes for them can say why they are exact (``Plan.notes``).

Example:
    >>> note = inplace_notes({"full": {"b0": {"its input"}, "b1": set()}}, {}, ["b0", "b1"])[0]
    >>> note[:50]
    'b0: an in-place op in the forward writes into its '
    >>> inplace_parts(note)
    (['b0'], ['full'])
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

from torch import nn

from memfit.checkpointing.recompute import copies_made

__all__ = ["inplace_notes", "inplace_parts", "watch_copies"]

_INPLACE = ": an in-place op"


@contextlib.contextmanager
def watch_copies(model: nn.Module, blocks: Sequence[str], into: dict[str, set[str]]) -> Iterator[None]:
    """Record into ``into`` what each block's checkpointed calls copied while the context ran."""
    for b in blocks:
        copies_made(model.get_submodule(b), clear=True)
    yield
    into.update({b: copies_made(model.get_submodule(b)) for b in blocks})


def inplace_notes(
    copied: Mapping[str, Mapping[str, set[str]]], stand_in: Mapping[str, str], blocks: Sequence[str]
) -> list[str]:
    """One note per kind of in-place write, naming the blocks and the modes it happens in.

    Args:
        copied: per mode, per block measured, what it copied (see :func:`watch_copies`).
        stand_in: blocks not run, each to the identical block measured for it.
        blocks: every block, in order.
    """
    by_kind: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for mode, per_block in copied.items():
        kinds: dict[str, list[str]] = {}
        for name in blocks:
            for what in per_block.get(stand_in.get(name, name), ()):
                kinds.setdefault(what, []).append(name)
        for what, names in kinds.items():
            by_kind.setdefault((what, tuple(names)), []).append(mode)
    return [
        f"{', '.join(names)}{_INPLACE} in the forward writes into {what}; under {' or '.join(modes)} "
        "checkpointing memfit copies it just before the write, so the recompute is exact (the copy is "
        "counted in the profile)."
        for (what, names), modes in sorted(by_kind.items())
    ]


def inplace_parts(note: str) -> tuple[list[str], list[str]]:
    """The blocks and modes an :func:`inplace_notes` note names (empty for any other note)."""
    head, sep, rest = note.partition(_INPLACE)
    if not sep:
        return [], []
    modes = rest.partition("; under ")[2].partition(" checkpointing")[0]
    return head.split(", "), modes.split(" or ")
