"""The offload lever's price: the step's device bytes, its host bytes and the copies' time.

The ``offload`` lever (:mod:`memfit.levers.offload`) moves what chosen blocks keep for their
backward to host memory and brings it back one block ahead. :func:`offload_price` walks the
step model's events (:func:`memfit.stepmodel.events`) for a plan and takes out, at each, the
bytes of every offloaded block that is off the device then
(See Note [what offload takes off each moment]); :func:`moved_bytes` is what each block
moves, read from the profile. The time is each copy's bytes over the host link's measured
speed (:class:`memfit.records.long_context.HostLinkFacts`) less the compute it overlaps. A
pure function over records.

Trade-off: each offloaded block's kept bytes leave the device for most of the step, for two
copies over the host link and pinned host memory of the same size; the last block offloaded
saves nothing (its backward comes first), and a slow link exposes the copies' time.

Example:
    >>> from memfit.records import BlockStats, Profile
    >>> from memfit.records.long_context import HostLinkFacts
    >>> blocks = [BlockStats(f"b{i}", saved_bytes={"full": 100}, held_bytes={"full": 100},
    ...     forward_peak_bytes={"full": 300}, backward_peak_bytes={"full": 500},
    ...     output_bytes=100, forward_seconds=0.01, backward_seconds={"full": 0.03})
    ...     for i in range(4)]
    >>> prof = Profile("fp32", "cuda", 1, blocks, BlockStats("outside", saved_bytes={"full": 0},
    ...                backward_peak_bytes={"full": 0}), 0, 0, 0, 0)
    >>> link = HostLinkFacts("cuda:0", 1e4, 1e4)
    >>> price = offload_price(prof, "full", moved_bytes(prof, "full", ["b0", "b1", "b2", "b3"]), link)
    >>> price.plain_peak_bytes, price.peak_bytes, price.host_bytes, price.to_device_bytes
    (900, 700, 400, 300)
    >>> round(price.copy_seconds, 3), round(price.exposed_seconds, 3)
    (0.07, 0.0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from memfit.records import Profile
from memfit.records.long_context import HostLinkFacts
from memfit.stepmodel.memory import events
from memfit.stepmodel.options import micro_batch_scale, normalize_modes, tiling

__all__ = ["OffloadPrice", "moved_bytes", "offload_price"]

_PREFIXES = ("first micro-batch: ", "later micro-batch: ", "last micro-batch: ")
_HEAD = ("forward outside the blocks (head, loss)", "backward outside the blocks (loss, head)")


@dataclass(frozen=True)
class OffloadPrice:
    """A plan's step with some blocks offloaded, predicted."""

    peak_bytes: int
    """The device's peak."""
    peak_event: str
    plain_peak_bytes: int
    """The same plan's peak without offload."""
    host_bytes: int
    """Pinned host memory at most: every offloaded block's copy."""
    to_host_bytes: int
    to_device_bytes: int
    """Copied back: every offloaded block but the last (kept on the device)."""
    copy_seconds: float
    """Both ways, at the link's measured speeds."""
    exposed_seconds: float
    """The part of it no compute overlaps: what the step takes longer."""
    timeline: list[tuple[str, int]] = field(default_factory=list)


def moved_bytes(
    profile: Profile,
    modes: str | Mapping[str, str] | Sequence[str],
    blocks: Sequence[str],
    selective_kept: bool = False,
) -> dict[str, int]:
    """What offloading each of ``blocks`` moves at ``modes`` (per micro-batch of the profile's
    batch): a checkpointed block's input (the block before it's output, the first block's
    taken as shaped like its own output), a block that is not checkpointed everything it keeps;
    with ``selective_kept`` (torch routes what selective checkpointing keeps through the
    saved-tensor hooks: :func:`memfit.levers.offload.selective_kept_offloaded`) a selective
    block's kept outputs too (what it keeps beyond a fully checkpointed block)."""
    names = [b.name for b in profile.blocks]
    seq = normalize_modes(profile, modes)
    out = {}
    for name in blocks:
        k = names.index(name)
        block = profile.blocks[k]
        if seq[k] == "none":
            out[name] = block.saved_bytes["none"]
            continue
        out[name] = profile.blocks[k - 1].output_bytes if k else block.output_bytes
        if seq[k] == "selective" and selective_kept:
            out[name] += max(0, block.saved_bytes["selective"] - block.saved_bytes["full"])
    return out


# Note [what offload takes off each moment]
# memfit.levers.offload lets an offloaded block k's copies go when the next offloaded block,
# n(k), has run its forward, and brings them back when n(k)'s backward starts; the last one
# offloaded is never let go. So block k's moved bytes are off the device at the forward and
# the backward of every block after n(k), and at the head's forward and backward unless k is
# the last; everything else is the step model's event as it is. The step model counts a
# block's kept bytes from the moment they are made to the backward of the block that made
# them (a checkpointed block's input: the block before it), and each block's numbers are
# differences of measured totals, so whatever the moments hold beyond that is in them already:
# the price is exact where the step model is (tested against MemTracker on a CPU whose host
# copies it does not see, as a GPU's allocator does not see pinned host memory).


def _off(
    label: str,
    moved: Mapping[int, int],
    nxt: Mapping[int, int],
    checkpointed: set[int],
    names: dict[str, int],
) -> int:
    for p in _PREFIXES:
        label = label.removeprefix(p)
    if label in _HEAD:
        return sum(b for k, b in moved.items() if k in nxt)
    for kind in ("forward of ", "backward of "):
        if label.startswith(kind) and label[len(kind) :] in names:
            t = names[label[len(kind) :]]
            return sum(b for k, b in moved.items() if k in nxt and t > nxt[k])
    return 0


def offload_price(
    profile: Profile,
    modes: str | Mapping[str, str] | Sequence[str],
    moved: Mapping[str, int],
    link: HostLinkFacts,
    micro_batches: int = 1,
) -> OffloadPrice:
    """The step of ``profile`` at ``modes`` with the blocks of ``moved`` offloaded (See Note
    [what offload takes off each moment]).

    Args:
        profile: the step's profile (without offload).
        modes: the plan's checkpointing modes (segments are not priced).
        moved: offloaded block -> bytes it moves (:func:`moved_bytes`).
        link: the host link's speeds (zero: the copies' time is not priced).
        micro_batches: the plan's micro-batches (each moves its share).
    """
    names = {b.name: k for k, b in enumerate(profile.blocks)}
    s = micro_batch_scale(profile.batch_size, micro_batches)
    by_index = {names[n]: round(s * b) for n, b in moved.items()}
    order = sorted(by_index)
    nxt = {k: order[i + 1] for i, k in enumerate(order[:-1])}
    seq = normalize_modes(profile, modes)
    checkpointed = {k for k in by_index if seq[k] != "none"}
    chosen = tiling(profile, modes)
    timeline = []
    plain = 0
    for ev in events(profile, micro_batches, chosen):
        value = ev.value(chosen)
        plain = max(plain, value)
        timeline.append((ev.label, value - _off(ev.label, by_index, nxt, checkpointed, names)))
    at = max(range(len(timeline)), key=lambda i: timeline[i][1])
    to_host = sum(by_index.values()) * micro_batches
    to_device = sum(by_index[k] for k in nxt) * micro_batches
    copy, exposed = _seconds(profile, seq, by_index, nxt, link)
    return OffloadPrice(
        peak_bytes=timeline[at][1],
        peak_event=timeline[at][0],
        plain_peak_bytes=plain,
        host_bytes=sum(by_index.values()),
        to_host_bytes=to_host,
        to_device_bytes=to_device,
        copy_seconds=copy * micro_batches,
        exposed_seconds=exposed * micro_batches,
        timeline=timeline,
    )


def _seconds(
    profile: Profile,
    seq: Sequence[str],
    moved: Mapping[int, int],
    nxt: Mapping[int, int],
    link: HostLinkFacts,
) -> tuple[float, float]:
    """Seconds of one micro-batch's copies, and the part the blocks they overlap do not hide: a
    block's copy out runs beside the forwards up to the next offloaded block's, its copy back
    beside the backwards from that block's down to its own."""
    up, down = link.to_host_bytes_per_second, link.to_device_bytes_per_second
    if up <= 0 or down <= 0:
        return 0.0, 0.0
    copy = exposed = 0.0
    blocks = profile.blocks
    for k, nbytes in moved.items():
        out = nbytes / up
        copy += out
        if k not in nxt:
            continue  # the last: its copy runs beside the rest of the forward, never waited on
        span = range(k + 1, nxt[k] + 1)
        back = nbytes / down
        copy += back
        exposed += max(0.0, out - sum(blocks[j].forward_seconds for j in span))
        exposed += max(0.0, back - sum(blocks[j].backward_seconds.get(seq[j], 0.0) for j in span))
    return copy, exposed
