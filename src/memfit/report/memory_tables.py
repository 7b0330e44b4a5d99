"""Tables and verdict lines for ``memfit estimate`` and ``memfit profile``.

Rows are strategies (precision / checkpointing mode), columns the parts of the peak
(parameters, gradients, optimizer, activations, temporaries), the peak, and whether it
fits the device memory. The verdict line answers the user's question: which is the
fastest-looking strategy that fits, or that none fits and by how much.

Example:
    >>> from memfit.records import EstimateEntry
    >>> e = EstimateEntry("fp32", "none", 10, {"params": 4, "grads": 0, "optimizer": 0,
    ...                   "activations": 6, "temporaries": 0})
    >>> verdict_line([e], 8).split(":")[0]
    'nothing fits in 8 B'
"""

from __future__ import annotations

from collections.abc import Sequence

from memfit.budget import format_bytes
from memfit.records import BREAKDOWN_KEYS, EstimateEntry, HeadFacts, Profile
from memfit.records.long_context import LongestAnswer, LongestEstimate
from memfit.report.table import text_table
from memfit.stepmodel.head_chunks import chunk_ladder, head_cost_at

__all__ = [
    "STRATEGY_HEADERS",
    "block_table",
    "head_table",
    "longest_line",
    "longest_table",
    "strategy_table",
    "verdict_line",
]

STRATEGY_HEADERS = (
    "strategy",
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "temporaries",
    "peak",
    "fits?",
)
_MODE_WORDS = {
    "none": "no checkpointing",
    "selective": "selective checkpointing",
    "full": "full checkpointing",
}


def _label(e: EstimateEntry) -> str:
    return f"{e.precision} / {e.mode}"


def _fits(peak: int, device_memory: int | None) -> str:
    if device_memory is None:
        return "-"
    return "yes" if peak <= device_memory else "no"


def strategy_table(entries: Sequence[EstimateEntry], device_memory: int | None) -> str:
    """One row per strategy, in the order given."""
    rows = [
        [
            _label(e),
            *(format_bytes(e.breakdown.get(k, 0)) for k in BREAKDOWN_KEYS),
            format_bytes(e.peak_bytes),
            _fits(e.peak_bytes, device_memory),
        ]
        for e in entries
    ]
    return text_table(STRATEGY_HEADERS, rows)


def verdict_line(ordered: Sequence[EstimateEntry], device_memory: int | None) -> str:
    """The answer: the first entry (fastest-looking first) that fits, or the shortfall."""
    if not ordered:
        return "nothing was estimated."
    smallest = min(ordered, key=lambda e: e.peak_bytes)
    words = f"{smallest.precision} with {_MODE_WORDS.get(smallest.mode, smallest.mode)}"
    if device_memory is None:
        return (
            f"smallest strategy: {words}, {format_bytes(smallest.peak_bytes)}; "
            "give --device-memory (e.g. 24GiB) to see what fits."
        )
    for e in ordered:
        if e.peak_bytes <= device_memory:
            return (
                f"fits in {format_bytes(device_memory)}: {e.precision} with "
                f"{_MODE_WORDS.get(e.mode, e.mode)} (peak {format_bytes(e.peak_bytes)}) is the "
                "fastest-looking strategy that fits."
            )
    short = smallest.peak_bytes - device_memory
    static = sum(smallest.breakdown.get(k, 0) for k in ("params", "grads", "optimizer"))
    if static >= device_memory:
        hint = (
            f"parameters, gradients and optimizer state alone take {format_bytes(static)}, so "
            "only fewer bytes for them (the levers: bf16 weights, low-bit optimizer state, the step "
            "in the backward), fewer parameters or sharding across devices can fit"
        )
    else:
        hint = "use a smaller batch or shorter sequences"
    return (
        f"nothing fits in {format_bytes(device_memory)}: the smallest strategy, {words}, needs "
        f"{format_bytes(smallest.peak_bytes)}, {format_bytes(short)} more; {hint}."
    )


def block_table(prof: Profile) -> str:
    """Per block (and outside): parameters, kept bytes and backward transients per mode, time, FLOPs."""
    modes = list(prof.outside.saved_bytes)
    headers = ["block", "params"]
    headers += [f"kept {m}" for m in modes] + [f"bw peak {m}" for m in modes]
    headers += ["fw ms", *[f"bw ms {m}" for m in modes], "fw GFLOP"]
    rows = []
    for b in [*prof.blocks, prof.outside]:
        row = [b.name, format_bytes(b.param_bytes)]
        row += [format_bytes(b.saved_bytes.get(m, 0)) for m in modes]
        row += [format_bytes(b.backward_peak_bytes.get(m, 0)) for m in modes]
        row += [f"{b.forward_seconds * 1e3:.2f}"]
        row += [f"{b.backward_seconds.get(m, 0.0) * 1e3:.2f}" for m in modes]
        row += [f"{b.forward_flops / 1e9:.3f}"]
        rows.append(row)
    return text_table(headers, rows)


def _chunks(facts: HeadFacts, chunk: int) -> str:
    size = min(chunk, facts.tokens)
    count = -(-facts.tokens // max(1, size))
    return (
        f"chunked_loss, {count:,} chunk{'s' if count > 1 else ''} of {size:,} token{'s' if size > 1 else ''}"
    )


def head_table(facts: HeadFacts | None, precision: str = "") -> str | None:
    """The loss head on its own rows, plain and with ``chunked_loss`` at the default chunk and
    at the smaller chunks the planner may choose; None when there is no head.

    The bytes are the head's alone (projection and cross-entropy on the step's hidden states,
    its input alive), as measured or estimated by
    :func:`memfit.measuring.lever_facts.head_facts`; a refused lever says why instead.

    Example:
        >>> from memfit.records import HeadCost
        >>> f = HeadFacts(tokens=8, hidden=4, vocab=100, chunk_tokens=2,
        ...               plain=HeadCost(3200, 6400, 6400), chunked=HeadCost(1600, 2000, 1600))
        >>> print(head_table(f).splitlines()[3].split("  ")[0])
        chunked_loss, 4 chunks of 2 tokens
    """
    if facts is None:
        return None
    at = f", {precision}" if precision else ""
    title = f"loss head{at} ({facts.tokens:,} tokens x {facts.vocab:,} vocabulary)"
    if facts.refused:
        return f"{title}: chunked_loss cannot shrink it: {facts.refused}"
    rows = []
    heads = [("plain", facts.plain), (_chunks(facts, facts.chunk_tokens), facts.chunked)]
    # the smaller chunks the planner may choose (See Note [the largest chunk that fits])
    for size in chunk_ladder(facts.default_chunk_tokens)[1:] if facts.small_chunk_tokens else []:
        word = "measured" if size == facts.small_chunk_tokens else "predicted"
        heads.append((f"{_chunks(facts, size)} ({word})", head_cost_at(facts, size)))
    for name, cost in heads:
        rows.append([name, format_bytes(cost.saved_bytes), format_bytes(cost.forward_peak_bytes),
                     format_bytes(cost.backward_peak_bytes)])  # fmt: skip
    table = text_table([title, "keeps", "forward peak", "backward peak"], rows)
    note = (
        "(chunked_loss keeps the head weight's fp32 gradient, "
        f"{format_bytes(facts.weight_grad_bytes)}, from its forward: the plain head makes it in its backward)"
        if facts.weight_grad_bytes
        else "(the head is frozen: neither head makes its weight's gradient)"
    )
    return f"{table}\n{note}"


def longest_table(found: LongestEstimate) -> str:
    """``memfit estimate --maximize seq_len``: one row per lever tier, its longest sequence, that
    step's peak split by role, and what one grain more needs."""
    headers = ["lever tier", "longest", "strategy", *STRATEGY_HEADERS[1:-1], "host", "+1 grain", "its peak"]
    rows = []
    for a in found.answers:
        step = [f"{a.precision} / {a.mode}", *(format_bytes(a.breakdown.get(k, 0)) for k in BREAKDOWN_KEYS)]
        step += [format_bytes(a.peak_bytes), format_bytes(a.host_bytes) if a.host_bytes else "-"]
        nxt = [f"{a.next_tokens:,}", format_bytes(a.next_peak_bytes)] if a.next_tokens else ["-", "-"]
        rows.append(
            [a.tier, f"{a.tokens:,}", *(step if a.tokens else ["-"] * len(step)), *nxt, a.event or "-"]
        )
    headers.append("peak at")
    return text_table(headers, rows)


def longest_line(a: LongestAnswer, device_memory: int) -> str:
    """One tier's answer in a sentence.

    Example:
        >>> a = LongestAnswer("levers", ["chunked_loss"], 2048, ["chunked_loss"], "bf16", "full", 900,
        ...                   next_tokens=3072, next_peak_bytes=1100)
        >>> head, rest = longest_line(a, 1000).split(": ", 1)
        >>> head
        'longest sequence with levers chunked_loss (of chunked_loss)'
        >>> rest
        '2,048 tokens, peak 900 B of 1000 B; 3,072 tokens need 1.07 KiB'
    """
    memory = format_bytes(device_memory)
    if not a.tokens:
        return (
            f"longest sequence with {a.tier}: none fits {memory}; {a.next_tokens:,} tokens (one grain) need "
            f"{format_bytes(a.next_peak_bytes)}"
        )
    using = "no levers"
    if a.allowed:
        using = f"levers {', '.join(a.levers) or 'none'} (of {', '.join(a.allowed)})"
    head = (
        f"longest sequence with {using}: {a.tokens:,} tokens, peak {format_bytes(a.peak_bytes)} of {memory}"
    )
    if a.next_tokens:
        return f"{head}; {a.next_tokens:,} tokens need {format_bytes(a.next_peak_bytes)}"
    return f"{head}; the search stops there ({a.limit})"
