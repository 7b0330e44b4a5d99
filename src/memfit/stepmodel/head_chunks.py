"""The chunked loss head's bytes at any chunk size, from two measured chunk sizes.

The ``chunked_loss`` lever (:mod:`memfit.levers.loss_head`) runs the loss head over chunks
of tokens. :func:`chunk_ladder` is the chunk sizes the planner chooses from, largest
first; :func:`head_cost_at` predicts the head's bytes at any chunk size from the two the
head was measured at (:class:`memfit.records.HeadFacts`: the default and the ladder's
smallest; See Note [the head's bytes are affine in the chunk]); :func:`at_chunk` is a
profile whose head facts describe the head at another chunk size, which
:func:`memfit.applying.registry.with_levers` then reads like the measured one.

Trade-off: a smaller chunk holds fewer logits at a time and runs more, smaller matmuls
(one Python iteration per chunk), so the planner takes the largest chunk that fits.

Example:
    >>> from memfit.records import HeadCost, HeadFacts
    >>> chunk_ladder(384)
    [384, 96, 24, 6, 1]
    >>> h = HeadFacts(tokens=384, vocab=100, chunk_tokens=384, default_chunk_tokens=384,
    ...               default_cost=HeadCost(10, 4000, 50), small_chunk_tokens=1,
    ...               small_cost=HeadCost(10, 170, 50))
    >>> head_cost_at(h, 96)
    HeadCost(saved_bytes=10, forward_peak_bytes=1120, backward_peak_bytes=50)
    >>> chunk_fixed_bytes(h, 96), chunk_fixed_bytes(h, 384)
    (960, 0)
"""

from __future__ import annotations

import dataclasses

from memfit.records import HeadCost, HeadFacts, Profile

__all__ = ["LADDER_RUNGS", "LADDER_STEP", "at_chunk", "chunk_fixed_bytes", "chunk_ladder", "head_cost_at"]

#: Each rung of the ladder is the one above divided by this.
LADDER_STEP = 4
#: At most this many rungs (the default, /4, /16, /64, /256), down to 1 token.
LADDER_RUNGS = 5

# Note [the head's bytes are affine in the chunk]
# The chunked head (memfit.levers.loss_head) allocates, whatever the chunk size c, the
# same tensors: the hidden states' gradient (tokens x hidden), the weight's fp32 gradient
# (vocab x hidden) and, inside one chunk, the chunk's logits (c x vocab, fp32, plus their
# autocast copy under bf16) and a few c-long vectors (row maxima, sums, labels, mask),
# freed before the next chunk. At every moment the live bytes are a + b * c for constants
# of that moment, and the code path does not depend on c, so the head's keeps, forward
# peak and backward peak are each a maximum of such lines; in practice one moment (inside
# a chunk) holds the forward's peak for every c, so each is one line: exact from two
# chunk sizes. The two measured (memfit.measuring.lever_facts.head_facts) are the ladder's
# ends, the default and the smallest, so every rung between is interpolated; were two
# moments to trade the peak, the chord of a maximum of lines lies above it, so a rung
# between is over-predicted, never under. (On a CPU MemTracker counts each tensor's bytes
# exactly; on CUDA it rounds each to 512 bytes, a few KiB on the c-long vectors.) A chunk
# counts at most the step's tokens (the last, or only, chunk is the rest). With
# micro-batches the step model scales the head's
# bytes by the micro-batch's share of tokens; one chunk's part, b * c, does not shrink
# while the chunk is smaller than the tokens, so for a chunk below the step's tokens it is
# kept whole (chunk_fixed_bytes): exact with one micro-batch and with chunks no larger
# than a micro-batch's tokens, an upper bound between.


def chunk_ladder(default: int) -> list[int]:
    """Chunk sizes the planner chooses from, largest first: ``default`` (the default chunk,
    at most the step's tokens) divided by 4 per rung, at most 5 rungs, down to 1 token."""
    rungs = [default // LADDER_STEP**k for k in range(LADDER_RUNGS)]
    return list(dict.fromkeys(r for r in rungs if r >= 1))


def _effective(head: HeadFacts, chunk: int) -> int:
    return max(1, min(chunk, head.tokens)) if head.tokens else chunk


def head_cost_at(head: HeadFacts, chunk: int) -> HeadCost:
    """The chunked head's bytes at ``chunk`` tokens per chunk, on the line through its two
    measured chunk sizes (Note [the head's bytes are affine in the chunk]); the measured
    cost itself where only one was measured or ``chunk`` is one of them."""
    lo, hi = head.small_chunk_tokens, head.default_chunk_tokens
    if not hi:  # facts from before two chunks were measured
        return head.chunked
    c = _effective(head, chunk)
    if not lo or lo == hi or c == hi:
        return head.default_cost
    if c == lo:
        return head.small_cost
    a, b = head.small_cost, head.default_cost
    f = (c - lo) / (hi - lo)
    values = [
        max(0, round(x + (y - x) * f))
        for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b), strict=True)
    ]
    return HeadCost(*values)


def chunk_fixed_bytes(head: HeadFacts, chunk: int) -> int:
    """One chunk's bytes in the head's forward peak that do not shrink with micro-batches:
    the measured line's slope times the chunk, for a chunk smaller than the step's tokens
    (0 for one chunk of every token, or without two measured chunks)."""
    lo, hi = head.small_chunk_tokens, head.default_chunk_tokens
    c = _effective(head, chunk)
    if not lo or not hi or lo == hi or c >= head.tokens:
        return 0
    slope = (head.default_cost.forward_peak_bytes - head.small_cost.forward_peak_bytes) / (hi - lo)
    return max(0, round(slope * c))


def at_chunk(profile: Profile, chunk: int) -> Profile:
    """``profile`` with its head facts at ``chunk`` tokens per chunk (a shallow copy; the same
    profile when it has no head facts or ``chunk`` is 0)."""
    facts = profile.lever_facts
    head = facts.head if facts is not None else None
    if facts is None or head is None or head.refused or not chunk:
        return profile
    moved = dataclasses.replace(head, chunk_tokens=chunk, chunked=head_cost_at(head, chunk))
    return dataclasses.replace(profile, lever_facts=dataclasses.replace(facts, head=moved))
