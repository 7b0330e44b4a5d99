"""The offload lever's price (memfit.stepmodel.offload) on synthetic profiles: device bytes at
each moment, host bytes, and the copies' time from bytes and a host-link speed.

The measured side (MemTracker against the price, to the byte) is tests/test_offload.py.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from synthetic_profiles import profiles

from memfit.records import BlockStats, Profile
from memfit.records.long_context import HostLinkFacts
from memfit.stepmodel import simulate
from memfit.stepmodel.offload import moved_bytes, offload_price

MiB = 2**20


def _chain(n: int = 6, saved: int = 10 * MiB, fwd_s: float = 0.010, bwd_s: float = 0.030) -> Profile:
    """A chain of ``n`` equal blocks at long context: each keeps its input (``saved``) under full
    checkpointing, and its backward holds four times that above what is kept."""
    blocks = [
        BlockStats(
            f"b{i}", param_bytes=MiB, grad_bytes=MiB, output_bytes=saved,
            saved_bytes={"full": saved}, held_bytes={"full": saved},
            forward_peak_bytes={"full": 3 * saved}, backward_peak_bytes={"full": 4 * saved + MiB},
            forward_seconds=fwd_s, backward_seconds={"full": bwd_s},
        )
        for i in range(n)
    ]  # fmt: skip
    outside = BlockStats("outside", saved_bytes={"full": 0}, backward_peak_bytes={"full": 2 * saved})
    return Profile("bf16", "cuda", 1, blocks, outside, n * MiB, n * MiB, 2 * n * MiB, 0)


def test_a_chain_keeps_two_inputs_at_its_last_backward_instead_of_all() -> None:
    """Every block offloaded: at the last block's backward the device holds its own input and
    the one prefetched (the blocks before it have theirs on the host)."""
    prof = _chain()
    names = [b.name for b in prof.blocks]
    price = offload_price(prof, "full", moved_bytes(prof, "full", names), HostLinkFacts("cuda:0", 1e10, 1e10))
    plain = simulate(prof, "full")
    assert price.plain_peak_bytes == plain.peak_bytes and plain.peak_event == "backward of b5"
    # the plain step keeps six inputs at b5's backward; offloaded, b3..b0's are on the host
    at = dict(price.timeline)
    assert plain.peak_bytes - at["backward of b5"] == 4 * 10 * MiB
    # b1's backward (two inputs kept, as in the plain step) now holds the peak: the gradients
    assert (
        price.peak_event == "backward of b1"
        and at["backward of b1"] == dict(plain.timeline)["backward of b1"]
    )
    assert price.host_bytes == price.to_host_bytes == 6 * 10 * MiB
    assert price.to_device_bytes == 5 * 10 * MiB  # the last block's input stays on the device
    # 10 MiB at 10 GB/s: about 1 ms each way, hidden behind 10 ms forwards and 30 ms backwards
    assert abs(price.copy_seconds - 11 * 10 * MiB / 1e10) < 1e-12 and price.exposed_seconds == 0.0


def test_a_slow_link_exposes_the_copies_time() -> None:
    """At 0.5 GB/s a 10 MiB copy takes 21 ms: 11 ms more than the next forward, none more than
    the 30 ms backward it overlaps."""
    prof = _chain()
    names = [b.name for b in prof.blocks]
    price = offload_price(prof, "full", moved_bytes(prof, "full", names), HostLinkFacts("cuda:0", 5e8, 5e8))
    per_copy = 10 * MiB / 5e8
    assert abs(price.exposed_seconds - 5 * (per_copy - 0.010)) < 1e-12
    both = offload_price(prof, "full", moved_bytes(prof, "full", names), HostLinkFacts("cuda:0", 5e8, 1e8))
    assert abs(both.exposed_seconds - 5 * (per_copy - 0.010) - 5 * (10 * MiB / 1e8 - 0.030)) < 1e-12


def test_offloading_the_last_block_alone_saves_nothing_and_copies_once() -> None:
    prof = _chain()
    price = offload_price(prof, "full", {"b5": 10 * MiB}, HostLinkFacts("cuda:0", 1e10, 1e10))
    assert price.peak_bytes == price.plain_peak_bytes and price.to_device_bytes == 0


def test_micro_batches_move_their_share() -> None:
    prof = dataclasses.replace(_chain(), batch_size=4)
    names = [b.name for b in prof.blocks]
    link = HostLinkFacts("cuda:0", 1e10, 1e10)
    one = offload_price(prof, "full", moved_bytes(prof, "full", names), link)
    two = offload_price(prof, "full", moved_bytes(prof, "full", names), link, micro_batches=2)
    assert two.host_bytes == one.host_bytes // 2 and two.to_host_bytes == one.to_host_bytes
    label = "later micro-batch: backward of b5"
    plain = dict(simulate(prof, "full", 2).timeline)
    assert plain[label] - dict(two.timeline)[label] == 4 * 10 * MiB // 2


@settings(max_examples=80, deadline=None)
@given(
    profile=profiles(max_blocks=7, segments=False),
    pick=st.lists(st.booleans(), min_size=7, max_size=7),
    micro=st.sampled_from([1, 2]),
    speed=st.floats(1e6, 1e11),
)
def test_offload_never_adds_device_bytes_and_counts_what_it_moves(
    profile: Profile, pick: list[bool], micro: int, speed: float
) -> None:
    names = [b.name for b in profile.blocks]
    chosen = [n for n, p in zip(names, pick, strict=False) if p]
    moved = moved_bytes(profile, "full", chosen)
    link = HostLinkFacts("cuda:0", speed, speed)
    price = offload_price(profile, "full", moved, link, micro)
    plain = simulate(profile, "full", micro)
    assert price.plain_peak_bytes == plain.peak_bytes
    assert price.peak_bytes <= plain.peak_bytes
    for (label, value), (same, before) in zip(price.timeline, plain.timeline, strict=True):
        assert label == same and value <= before  # no moment holds more
    assert price.host_bytes <= sum(moved.values())
    assert 0.0 <= price.exposed_seconds <= price.copy_seconds + 1e-12
    faster = offload_price(profile, "full", moved, HostLinkFacts("cuda:0", 2 * speed, 2 * speed), micro)
    assert faster.exposed_seconds <= price.exposed_seconds + 1e-12
    if len(chosen) <= 1:  # one block offloaded is the last: its copy is never let go
        assert price.peak_bytes == plain.peak_bytes and price.to_device_bytes == 0
    assert offload_price(profile, "full", {}, link, micro).peak_bytes == plain.peak_bytes
