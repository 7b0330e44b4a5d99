"""Long context: what the long-context levers' prices rest on (the tiled MLP's bytes, the host
link's speed), and the longest sequence an estimate finds.

:class:`TiledMlpFacts` is measured on one MLP alone at the step's shape
(:func:`memfit.measuring.long_context.tiled_mlp_facts`) and read by
:mod:`memfit.stepmodel.tiled_mlp`; :class:`HostLinkFacts` by :mod:`memfit.stepmodel.offload`.
:class:`LongestEstimate` is what :func:`memfit.planning.longest_estimate.longest_estimate`
(``memfit estimate --maximize seq_len``) answers, one :class:`LongestAnswer` per lever tier.

Example:
    >>> f = TiledMlpFacts(modules=["blocks.0.mlp"], rows=1, positions=64, hidden=32,
    ...                   plain={"none": MlpCost(100, 300, 400)})
    >>> TiledMlpFacts.from_json(f.to_json()) == f
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.records.base import Record

__all__ = ["HostLinkFacts", "LongestAnswer", "LongestEstimate", "MlpCost", "TiledMlpFacts"]


@dataclass
class MlpCost(Record):
    """Bytes of one MLP's forward and backward at the step's shape, as MemTracker counts them,
    each above the total just before its forward (its input alive), in one checkpointing mode
    (the MLP alone checkpointed as a block would be)."""

    saved_bytes: int = 0
    """Kept from its forward to its backward (its output, which the block's residual add
    frees, not counted; in a checkpointed mode, the checkpoint's input)."""
    forward_peak_bytes: int = 0
    """Highest while its forward runs."""
    backward_peak_bytes: int = 0
    """Highest while its backward runs, recompute and its parameters' gradients included."""
    held_bytes: int = 0
    """Alive when its forward returns: the kept bytes and autocast's weight casts, which the
    forward's end frees where the backward does not keep them (0: not measured)."""


@dataclass
class TiledMlpFacts(Record):
    """One block's MLP, plain and tiled at each chunk count of the ladder, per checkpointing
    mode; every MLP in :attr:`modules` is taken to cost the same (a decoder's MLPs have one
    shape)."""

    modules: list[str] = field(default_factory=list)
    """The MLPs the tiled MLP runs (:func:`memfit.levers.tiled_mlp.find_mlps`)."""
    rows: int = 0
    """Sequences in the step (the input's dimensions before the sequence, multiplied)."""
    positions: int = 0
    """Positions per sequence: what the chunks split."""
    hidden: int = 0
    """The MLP input's last dimension."""
    plain: dict[str, MlpCost] = field(default_factory=dict)
    """Per checkpointing mode, the plain MLP's bytes."""
    chunk_counts: list[int] = field(default_factory=list)
    """The chunk counts measured (:func:`memfit.stepmodel.tiled_mlp.mlp_chunk_counts`), fewest
    first (none where the sequence is too short to split)."""
    tiled: list[dict[str, MlpCost]] = field(default_factory=list)
    """Per measured chunk count (same order), per mode, the tiled MLP's bytes."""
    refused: str = ""
    """Why the tiled MLP cannot run on this step ("" : it can)."""
    chunks: int = 0
    """The count a profile's blocks are priced at (the planner's setting; 0: the ladder's last,
    :func:`memfit.applying.tiled_mlp.chosen_chunks`)."""
    floor: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    """Per block, its numbers with every MLP tiled at the ladder's last count, measured in one
    step per mode: ``{block: {"saved_bytes" | "held_bytes" | "forward_peak_bytes" |
    "backward_peak_bytes": {mode: bytes}}}``, a bound no count goes under (empty: not
    measured; See Note [a tiled MLP in its block] in :mod:`memfit.stepmodel.tiled_mlp`)."""


@dataclass
class HostLinkFacts(Record):
    """The link between device and host memory, measured on the device with pinned buffers
    (:func:`memfit.measuring.long_context.host_link_facts`)."""

    device: str = ""
    to_host_bytes_per_second: float = 0.0
    """Device to pinned host memory, on a side stream."""
    to_device_bytes_per_second: float = 0.0
    """Pinned host memory to the device, on a side stream."""
    probe_bytes: int = 0
    """Bytes of the buffer each copy was timed on (median of a few)."""
    refused: str = ""
    """Why activations cannot go to host memory here ("" : they can), e.g. a CPU."""


@dataclass
class LongestAnswer(Record):
    """The longest sequence one lever tier fits in the device memory, predicted on fake tensors;
    its step is the smallest over the tier's lever sets, precisions and uniform checkpointing
    modes, at one micro-batch."""

    tier: str = ""
    """"no levers", "levers" (the allowed levers but offload) or "levers and offload"."""
    allowed: list[str] = field(default_factory=list)
    """The levers the tier may use ([]: none)."""
    tokens: int = 0
    """The longest sequence that fits, a multiple of the grain (0: not even one grain)."""
    levers: list[str] = field(default_factory=list)
    """The lever set of the smallest step at :attr:`tokens`."""
    precision: str = ""
    mode: str = ""
    """The checkpointing mode of every block in that step."""
    peak_bytes: int = 0
    """That step's predicted peak (0 where :attr:`tokens` is 0)."""
    breakdown: dict[str, int] = field(default_factory=dict)
    """The peak split into :data:`memfit.records.BREAKDOWN_KEYS`; adds up to :attr:`peak_bytes`."""
    host_bytes: int = 0
    """Pinned host memory the step offloads to (0: no offload)."""
    event: str = ""
    """Where in the step the peak is, e.g. "backward outside the blocks (loss, head)" (the step
    model's event)."""
    next_tokens: int = 0
    """One grain more (0: the search stopped at :attr:`limit` instead)."""
    next_peak_bytes: int = 0
    """The smallest predicted step at :attr:`next_tokens`: over the device memory."""
    limit: str = ""
    """What stopped the search before the memory did ("": the memory)."""


@dataclass
class LongestEstimate(Record):
    """The longest sequence each lever tier fits in :attr:`device_memory`, predicted on fake
    tensors (nothing allocated)."""

    model: str
    param_count: int
    batch_size: int
    """Rows of the batch; the sequence is what grows."""
    optimizer: str
    device_memory: int
    grain: int
    """Lengths searched are multiples of this many tokens."""
    answers: list[LongestAnswer] = field(default_factory=list)
    """One per tier: no levers, the allowed levers but offload, all allowed levers."""
    longest: int = 0
    """The longest length searched (a position table, the cap asked for), a multiple of the grain."""
    probes: list[int] = field(default_factory=list)
    """The lengths estimated, in the order they ran."""
    probe_seconds: list[float] = field(default_factory=list)
    """Seconds each took (same order)."""
    refused: dict[str, str] = field(default_factory=dict)
    """Allowed levers the estimate cannot predict, and why."""
    assumptions: list[str] = field(default_factory=list)
