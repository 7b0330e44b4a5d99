"""The tiled MLP's bytes at any chunk count, and a profile's blocks with their MLPs tiled.

The tiled MLP (:mod:`memfit.levers.tiled_mlp`) runs each block's MLP over chunks of the
sequence. :func:`mlp_chunk_counts` is the ladder of chunk counts a plan chooses from;
:func:`mlp_cost_at` predicts one MLP's bytes at any count from the rungs measured
(:class:`memfit.records.long_context.TiledMlpFacts`;
See Note [the tiled MLP's bytes between measured counts]); :func:`with_tiled_mlp` is a
profile whose blocks hold tiled MLPs, which :func:`memfit.stepmodel.simulate` then reads
like a measured one (See Note [a tiled MLP in its block]). Pure functions over records.

Trade-off: more chunks hold a smaller piece of the intermediate and run more, smaller
matmuls (one Python iteration each), so a plan takes the fewest chunks that fit.

Example:
    >>> from memfit.records.long_context import MlpCost, TiledMlpFacts
    >>> facts = TiledMlpFacts(modules=["b0.mlp"], rows=1, positions=64, hidden=8,
    ...     plain={"full": MlpCost(0, 900, 2000)}, chunk_counts=[2, 64],
    ...     tiled=[{"full": MlpCost(0, 500, 1000)}, {"full": MlpCost(0, 190, 380)}])
    >>> mlp_chunk_counts(64), mlp_chunk_counts(5)
    ([2, 4, 8, 16, 32, 64], [2, 4])
    >>> mlp_cost_at(facts, 8, "full")
    MlpCost(saved_bytes=0, forward_peak_bytes=260, backward_peak_bytes=520, held_bytes=0)
    >>> mlp_cost_at(facts, 1, "full") == facts.plain["full"]
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from memfit.records import BlockStats, Profile
from memfit.records.long_context import MlpCost, TiledMlpFacts

__all__ = [
    "FLOOR_FIELDS",
    "MLP_LADDER",
    "floor_of",
    "mlp_chunk_counts",
    "mlp_cost_at",
    "mlp_saving",
    "tiled_block",
    "with_tiled_mlp",
]

#: Chunk counts a plan chooses from (each doubles the last), while the sequence has as many
#: positions.
MLP_LADDER = (2, 4, 8, 16, 32, 64)

# Note [the tiled MLP's bytes between measured counts]
# Whatever the chunk count, the tiled MLP allocates the same tensors: its output and its
# input's gradient (sequence x features), its parameters' gradients and their running sum,
# and, inside one chunk, that chunk's intermediate and its gradients, freed before the next
# chunk (Note [the tiled MLP's gradients]). Each of its three numbers is the largest of a few
# moments, each a line a + b * c in the largest chunk c = ceil(positions / count); which
# moment is largest changes with c (measured on memfit's LLaMA: two chunks put the backward's
# peak on another line than four or more), so two counts do not make every other exact. Every
# count of the ladder is measured (memfit.measuring.long_context: the MLP alone, cheap beside
# a step), so a plan's count is priced by its own measurement; a count between two rungs is
# on the chord between them, which lies above a maximum of lines (an over-prediction, never
# under); beyond the last rung it is priced at the last (a smaller chunk holds less: an upper
# bound); one chunk is the plain MLP, measured.


def mlp_chunk_counts(positions: int) -> list[int]:
    """The ladder's chunk counts for a sequence of ``positions`` (at most one chunk per
    position; empty where it cannot be split)."""
    return [n for n in MLP_LADDER if n <= positions] or ([positions] if positions >= 2 else [])


def _largest(positions: int, count: int) -> int:
    return -(-positions // max(1, min(count, positions)))


def mlp_cost_at(facts: TiledMlpFacts, chunks: int, mode: str) -> MlpCost:
    """One MLP's bytes in ``mode`` at ``chunks`` chunks; the plain MLP's at one chunk or where
    no count was measured (See Note [the tiled MLP's bytes between measured counts])."""
    counts = facts.chunk_counts
    if chunks <= 1 or not counts:
        return facts.plain[mode]
    n = min(max(chunks, counts[0]), counts[-1])
    k = next(i for i, m in enumerate(counts) if m >= n)
    if counts[k] == n or k == 0:
        return facts.tiled[k][mode]
    c, c_big, c_small = (_largest(facts.positions, m) for m in (n, counts[k - 1], counts[k]))
    f = (c - c_small) / (c_big - c_small) if c_big != c_small else 0.0
    small, big = facts.tiled[k][mode], facts.tiled[k - 1][mode]
    values = [
        max(0, round(x + (y - x) * f))
        for x, y in zip(dataclasses.astuple(small), dataclasses.astuple(big), strict=True)
    ]
    return MlpCost(*values)


def mlp_saving(facts: TiledMlpFacts, chunks: int, mode: str) -> MlpCost:
    """What tiling one MLP in ``chunks`` chunks takes off its plain bytes in ``mode`` (negative
    where the tiled MLP costs more: a sequence too short for chunks to pay off)."""
    plain, tiled = facts.plain[mode], mlp_cost_at(facts, chunks, mode)
    return MlpCost(
        *(p - t for p, t in zip(dataclasses.astuple(plain), dataclasses.astuple(tiled), strict=True))
    )


# Note [a tiled MLP in its block]
# A block's numbers (memfit.records.BlockStats) are each the largest of its moments; at long
# context the MLP's moment holds them (its intermediate is 3 to 4 times sequence x
# intermediate, against attention's few sequence x hidden), and tiling moves that moment by
# the MLP's own difference, measured alone in the same mode: what the block keeps falls by the
# MLP's kept bytes, what it holds at its forward's end by the MLP's held bytes (autocast's
# weight casts the tiled MLP's backward does not keep), its forward peak by the MLP's forward
# peak, its backward peak
# (above what the block keeps) by the MLP's backward peak less its kept bytes. Once the MLP
# is small another moment of the block (attention's backward) may hold the peak, which this
# difference under-predicts; a floor (the same step profiled with every MLP at the ladder's
# last count, the smallest chunk: TiledMlpFacts.floor, on a fake-tensor twin,
# memfit.measuring.long_context.tiled_floor) bounds it: a block's number is at least the
# floor's, and the larger of the two is exact where either moment holds the peak at both
# counts, an over-prediction between. Without the floor, issue 38's LoRA Llama at 6,144 tokens
# (both layers fully checkpointed, 64 chunks) was predicted 10,802,176 B under its measured
# step (attention's backward held the block's peak once the MLP was small); with it, exact.


def _moved(
    values: Mapping[str, int], by: Mapping[str, int], floor: Mapping[str, int] | None
) -> dict[str, int]:
    out = {}
    for mode, value in values.items():
        moved = max(0, value - by.get(mode, 0))
        out[mode] = max(moved, floor.get(mode, 0)) if floor is not None else moved
    return out


def tiled_block(block: BlockStats, facts: TiledMlpFacts, chunks: int) -> BlockStats:
    """``block`` with its MLP tiled in ``chunks`` chunks, never under the block's numbers in
    :attr:`TiledMlpFacts.floor` where they were measured (Note [a tiled MLP in its block])."""
    save = {m: mlp_saving(facts, chunks, m) for m in facts.plain}
    kept = {m: s.saved_bytes for m, s in save.items()}
    held = {m: s.held_bytes for m, s in save.items()}
    fwd = {m: s.forward_peak_bytes for m, s in save.items()}
    bwd = {m: s.backward_peak_bytes - s.saved_bytes for m, s in save.items()}
    f = facts.floor.get(block.name)
    return dataclasses.replace(
        block,
        saved_bytes=_moved(block.saved_bytes, kept, f.get("saved_bytes") if f else None),
        held_bytes=_moved(block.held_bytes, held, f.get("held_bytes") if f else None),
        forward_peak_bytes=_moved(block.forward_peak_bytes, fwd, f.get("forward_peak_bytes") if f else None),
        backward_peak_bytes=_moved(
            block.backward_peak_bytes, bwd, f.get("backward_peak_bytes") if f else None
        ),
    )


#: The block numbers a tiled MLP moves, and :attr:`TiledMlpFacts.floor` bounds.
FLOOR_FIELDS = ("saved_bytes", "held_bytes", "forward_peak_bytes", "backward_peak_bytes")


def floor_of(profile: Profile) -> dict[str, dict[str, dict[str, int]]]:
    """:attr:`TiledMlpFacts.floor` from ``profile``, a step profiled with every MLP tiled at the
    ladder's last count.

    Example:
        >>> block = BlockStats("b", saved_bytes={"full": 8})
        >>> prof = Profile("fp32", "cpu", 1, [block], BlockStats("outside"), 0, 0, 0, 0)
        >>> floor_of(prof)["b"]["saved_bytes"]
        {'full': 8}
    """
    return {b.name: {f: dict(getattr(b, f)) for f in FLOOR_FIELDS} for b in profile.blocks}


def with_tiled_mlp(profile: Profile, facts: TiledMlpFacts, chunks: int) -> Profile:
    """``profile`` with every block whose MLP :attr:`TiledMlpFacts.modules` names tiled in
    ``chunks`` chunks (a shallow copy; See Note [a tiled MLP in its block]). The same profile
    where ``facts`` is refused or ``chunks`` is at most 1."""
    if facts.refused or chunks <= 1 or not facts.chunk_counts:
        return profile
    blocks = [
        tiled_block(b, facts, chunks) if _holds_mlp(b.name, facts.modules) else b for b in profile.blocks
    ]
    return dataclasses.replace(profile, blocks=blocks)


def _holds_mlp(block: str, modules: list[str]) -> bool:
    return any(m.startswith(f"{block}.") for m in modules)
