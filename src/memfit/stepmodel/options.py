"""What a plan chooses from: per block a checkpointing mode, or a segment of blocks as one.

An :class:`Option` covers blocks ``first..last``: one block in mode ``none``, ``selective``
or ``full``, or a segment (``last > first``) of consecutive blocks checkpointed as one, as
``torch.utils.checkpoint.checkpoint_sequential`` does: it keeps only the segment's input
and last output, and recomputes every block of it in its backward. A plan is a tiling of
the blocks by options; :func:`tiling` builds one from ``{block: mode}`` and segments.

Trade-off: a segment keeps less than its blocks checkpointed one by one (their outputs)
and pays one checkpoint call instead of several, but its backward holds every block's
recomputed activations at once; the solver weighs that with the rest.

Example:
    >>> from memfit.records import BlockStats, Profile
    >>> blocks = [BlockStats(f"b{i}", saved_bytes={"none": 1, "full": 1},
    ...                      backward_peak_bytes={"none": 1, "full": 1}) for i in range(3)]
    >>> prof = Profile("fp32", "cpu", 1, blocks, BlockStats("outside"), 0, 0, 0, 0,
    ...                chain_links=[True, True])
    >>> [o.label for o in tiling(prof, "none", segments=[["b0", "b1"]])]
    ['segment b0..b1', 'b2 none']
    >>> len(all_options(prof))  # 3 blocks x 2 modes + segments b0..b1, b1..b2, b0..b2
    9
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from memfit.errors import ConfigError
from memfit.records import BlockStats, Profile
from memfit.vocab import CHECKPOINT_MODES, CheckpointMode, normalize_mode

__all__ = [
    "MAX_SEGMENT",
    "Option",
    "Segments",
    "all_options",
    "block_options",
    "micro_batch_scale",
    "normalize_modes",
    "segment_ranges",
    "tiling",
]

#: Longest segment the solver considers (checkpoint_sequential's sqrt(n) split of 256 blocks).
MAX_SEGMENT = 16

#: Segments as lists of block names (as in :class:`memfit.Plan`) or ``(first, last)`` indices.
Segments = Iterable[Sequence[str] | tuple[int, int]]


@dataclass(frozen=True, order=True)
class Option:
    """Blocks ``first..last`` run as one choice: one block in ``mode``, or a segment."""

    first: int
    last: int
    mode: str = "full"
    name: str = ""
    """How it is shown: ``blocks.3 full`` or ``segment blocks.0..blocks.3``."""

    @property
    def segment(self) -> bool:
        """True for a run of two or more blocks checkpointed as one."""
        return self.last > self.first

    @property
    def label(self) -> str:
        return self.name or (
            f"segment {self.first}..{self.last}" if self.segment else f"{self.first} {self.mode}"
        )


def block_options(block: BlockStats) -> list[str]:
    """The checkpointing modes a block was profiled under, cheapest-compute first."""
    return [m for m in CHECKPOINT_MODES if m in block.saved_bytes and m in block.backward_peak_bytes]


def micro_batch_scale(batch_size: int, micro_batches: int) -> float:
    """Fraction of the batch's activations one micro-batch holds (the largest chunk)."""
    if micro_batches < 1:
        raise ConfigError(f"micro_batches must be at least 1, got {micro_batches}.")
    if batch_size < 1:
        return 1.0
    return math.ceil(batch_size / micro_batches) / batch_size


def _single(profile: Profile, k: int, mode: str) -> Option:
    return Option(k, k, mode, f"{profile.blocks[k].name} {mode}")


def _seg(profile: Profile, i: int, j: int) -> Option:
    return Option(i, j, "full", f"segment {profile.blocks[i].name}..{profile.blocks[j].name}")


def _segment_ok(profile: Profile, i: int, j: int) -> bool:
    links = profile.chain_links
    return all(k < len(links) and links[k] for k in range(i, j)) and all(
        {"none", "full"} <= set(block_options(profile.blocks[k])) for k in range(i, j + 1)
    )


def all_options(profile: Profile, max_segment: int = MAX_SEGMENT) -> list[Option]:
    """Every option of every block, and every segment the profile's chain links allow."""
    n = len(profile.blocks)
    out = [_single(profile, k, m) for k, b in enumerate(profile.blocks) for m in block_options(b)]
    for i in range(n):
        for j in range(i + 1, min(n, i + max_segment)):
            if not _segment_ok(profile, i, j):
                break
            out.append(_seg(profile, i, j))
    return out


def normalize_modes(profile: Profile, modes: str | Mapping[str, str] | Sequence[str]) -> list[CheckpointMode]:
    """Per-block modes in profile order from one mode for all, ``{name: mode}`` or a list.

    Raises:
        ConfigError: a block is missing, unknown, or its mode was not profiled.
    """
    names = [b.name for b in profile.blocks]
    if isinstance(modes, str):
        seq = [modes] * len(names)
    elif isinstance(modes, Mapping):
        unknown = sorted(set(modes) - set(names))
        if unknown:
            raise ConfigError(f"block(s) {unknown} are not in the profile; its blocks are {names}.")
        missing = [n for n in names if n not in modes]
        if missing:
            raise ConfigError(f"no mode given for block(s) {missing}; give one for every profiled block.")
        seq = [modes[n] for n in names]
    else:
        seq = list(modes)
        if len(seq) != len(names):
            raise ConfigError(f"got {len(seq)} modes for {len(names)} profiled blocks; give one per block.")
    out: list[CheckpointMode] = [normalize_mode(m) for m in seq]
    for block, mode in zip(profile.blocks, out, strict=True):
        if mode not in block_options(block):
            raise ConfigError(
                f"block {block.name!r} has no profiled mode {mode!r}; it has {block_options(block)}."
            )
    return out


def segment_ranges(profile: Profile, segments: Segments) -> list[tuple[int, int]]:
    """Segments as ``(first, last)`` block indices, checked: consecutive, disjoint, two or more blocks.

    Raises:
        ConfigError: a segment names unknown blocks, is not a run of consecutive blocks, or
            overlaps another.
    """
    index = {b.name: k for k, b in enumerate(profile.blocks)}
    out: list[tuple[int, int]] = []
    for seg in segments:
        if isinstance(seg, tuple) and len(seg) == 2 and all(isinstance(v, int) for v in seg):
            first, last = int(seg[0]), int(seg[1])
        else:
            names = [str(n) for n in seg]
            unknown = [n for n in names if n not in index]
            if unknown:
                raise ConfigError(f"segment {names} names block(s) {unknown} that the profile does not have.")
            ks = [index[n] for n in names]
            if ks != list(range(ks[0], ks[0] + len(ks))):
                raise ConfigError(f"segment {names} is not a run of consecutive blocks in forward order.")
            first, last = ks[0], ks[-1]
        if not 0 <= first < last < len(profile.blocks):
            raise ConfigError(f"a segment needs two or more consecutive blocks, got {seg!r}.")
        out.append((first, last))
    out.sort()
    for (_, a), (b, _) in itertools.pairwise(out):
        if b <= a:
            raise ConfigError(f"segments {out} overlap; a block can be in one segment only.")
    return out


def tiling(
    profile: Profile, modes: str | Mapping[str, str] | Sequence[str], segments: Segments = ()
) -> list[Option]:
    """The options of a plan, in block order: each block's mode, segments replacing their blocks.

    Blocks inside a segment need no mode (a plan records them as ``full``, which they must
    have been profiled in).
    """
    ranges = segment_ranges(profile, segments)
    inside = {k for a, b in ranges for k in range(a, b + 1)}
    names = [b.name for b in profile.blocks]
    if isinstance(modes, Mapping):
        modes = {**{names[k]: "full" for k in inside}, **dict(modes)}
    seq = normalize_modes(profile, modes)
    out = [_seg(profile, a, b) for a, b in ranges]
    out += [_single(profile, k, seq[k]) for k in range(len(names)) if k not in inside]
    return sorted(out)
