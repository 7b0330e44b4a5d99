"""The step's time: what each option costs, from counted work and a few measured speeds.

Timing every block in every mode on a busy machine gives a different plan each run (the
planner picks whichever option the noise favoured). Here a block's forward is *counted*:
its FLOPs (FlopCounterMode), the bytes it writes (MemTracker) and the aten ops it
dispatches, priced by the device's speed at each (micro-benchmarks,
:class:`memfit.records.Speed`) and scaled once so the model's whole forward and backward
match those of a few timed steps. Checkpointing a block costs its recompute (its forward
again; for selective only the ops it does not keep) plus a checkpoint call, and selective
checkpointing's dispatch mode a fixed time per op; a segment pays one call for all its
blocks. Counts are exact and the speeds enter only as ratios, so the same model gives the
same plan run after run.

Trade-off: the model prices work, not kernels: two options within a few percent of each
other are a tie it cannot break; the solver then takes the one with the lower peak.

Example:
    >>> from memfit.records import BlockStats, Profile, Speed
    >>> b = BlockStats("b0", saved_bytes={"none": 8, "full": 1}, backward_peak_bytes={"none": 1, "full": 2},
    ...                forward_flops=10**9, forward_bytes=0, forward_ops=0)
    >>> prof = Profile("fp32", "cpu", 1, [b], BlockStats("outside"), 0, 0, 0, 0,
    ...                speed=Speed(flop_seconds=1e-9, checkpoint_seconds=0.5))
    >>> fill_times(prof)
    >>> {m: round(t, 3) for m, t in block_seconds(prof.blocks[0]).items()}
    {'none': 3.0, 'full': 4.5}
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from memfit.records import BlockStats, Profile, Speed
from memfit.stepmodel.options import Option, Segments, block_options, micro_batch_scale, tiling

__all__ = [
    "block_seconds",
    "call_seconds",
    "fill_times",
    "forward_work",
    "micro_batch_ratio",
    "micro_batch_seconds",
    "option_seconds",
    "predict_options_seconds",
    "predict_step_seconds",
    "recompute_scale",
    "selective_work",
    "time_note",
]


def forward_work(profile: Profile, block: BlockStats) -> float:
    """Modelled seconds of ``block``'s forward at the device's raw speeds (before scaling)."""
    sp = profile.speed
    if sp is None:
        return 0.0
    return (
        block.forward_flops * sp.flop_seconds
        + block.forward_bytes * sp.byte_seconds
        + block.forward_ops * sp.op_seconds
    )


def selective_work(profile: Profile, block: BlockStats) -> float:
    """Modelled seconds (before scaling) of what selective checkpointing recomputes in ``block``:
    the FLOPs of the ops it does not keep, the bytes they write, and every op's dispatch."""
    sp = profile.speed
    if sp is None:
        return 0.0
    sel_bytes = max(0, block.forward_bytes - block.saved_bytes.get("selective", block.forward_bytes))
    return (
        block.selective_flops * sp.flop_seconds
        + sel_bytes * sp.byte_seconds
        + block.forward_ops * sp.op_seconds
    )


def fill_times(profile: Profile) -> None:
    """Write each block's (and the outside's) seconds per mode from the profile's time model.

    Needs ``profile.speed``; a profile without one keeps the times it has. Forward and
    no-checkpointing backward are the block's share of the scaled work; ``full`` adds its
    forward again and one checkpoint call; ``selective`` adds the ops it recomputes, one
    call and the selective dispatch time of every op, in the forward and in the recompute.
    """
    sp = profile.speed
    if sp is None:
        return
    for block in [*profile.blocks, profile.outside]:
        work = forward_work(profile, block)
        block.forward_seconds = sp.forward_scale * work
        plain = sp.backward_scale * work
        sel_work = selective_work(profile, block)
        recompute = sp.forward_scale * sp.recompute_scale
        extra = {
            "none": 0.0,
            "full": recompute * work + sp.checkpoint_seconds,
            "selective": recompute * sel_work
            + sp.checkpoint_seconds
            + 2 * block.forward_ops * sp.selective_op_seconds,
        }
        modes = block_options(block) if block is not profile.outside else list(block.saved_bytes)
        block.backward_seconds = {m: plain + extra[m] for m in modes}


def recompute_scale(profile: Profile) -> float:
    """The profile's fitted recompute speed relative to its forward (1 without a time model)."""
    return profile.speed.recompute_scale if profile.speed is not None else 1.0


def block_seconds(block: BlockStats, recompute: float = 1.0) -> dict[str, float]:
    """Forward + backward seconds per mode; a mode costs at least keeping plus its recompute."""
    # Measured times (profiles without a time model, estimates) are noisy, and a recompute
    # can come out as fast as keeping the activations; FLOPs are exact, so each mode costs
    # at least the ``none`` time plus its extra FLOPs at the block's forward speed times
    # ``recompute`` (the profile's recompute_scale).
    options = block_options(block)
    total = {m: block.forward_seconds + block.backward_seconds.get(m, 0.0) for m in options}
    if not options:
        return total
    floor = total[options[0]]
    base_flops = block.backward_flops.get(options[0], 0)
    speed = recompute * block.forward_seconds / block.forward_flops if block.forward_flops > 0 else 0.0
    return {
        m: max(t, floor + max(0, block.backward_flops.get(m, 0) - base_flops) * speed)
        for m, t in total.items()
    }


def option_seconds(
    profile: Profile, option: Option, times: Sequence[Mapping[str, float]] | None = None
) -> float:
    """Seconds of one option: its block's time in its mode; a segment, its blocks fully
    checkpointed less the checkpoint calls it saves (one call instead of one per block)."""
    per = times if times is not None else [block_seconds(b, recompute_scale(profile)) for b in profile.blocks]
    if not option.segment:
        return per[option.first][option.mode]
    call = profile.speed.checkpoint_seconds if profile.speed is not None else 0.0
    total = sum(per[k]["full"] for k in range(option.first, option.last + 1))
    return total - (option.last - option.first) * call


# Note [what a micro-batch costs]
# Splitting the batch into k micro-batches keeps its FLOPs and bytes (the parts add up to
# the batch) but runs every op k times, on fewer rows: each part pays its fixed cost per call
# k times, and kernels run less efficiently on fewer rows, each kind of block differently (a
# CNN's early convolutions, many pixels and few channels, barely notice a batch of one image;
# its late ones run several times slower per image); a checkpointed block pays again in its
# recompute, the gradients are accumulated k - 1 times (each read twice and written once,
# priced by its bytes), and the optimizer step runs once. What
# splitting costs is measured on the step itself: its forward and backward run whole, in 2
# micro-batches, in as many as it has rows and in a count between, the counts side by side
# with the whole run of their round (Speed.micro_batches,
# micro_batch_ratios; memfit/measuring/split_timing.py), linear in k between those (a call's
# ``a + b * rows`` makes k calls cost ``k * a + b * rows``). Every part pays that ratio of its
# whole time (one block timed split and carried to the others missed a CNN by 1.4x), and a
# checkpointed block pays it again on its recompute. Never less than its counted ops
# dispatched again once per extra micro-batch (a ratio below that is a disturbed timing, and
# without a measurement those ops alone are the price), never more than running whole once
# per extra micro-batch. A plan in k micro-batches costs its whole-batch time plus that:
# priced like everything else, never free, so the chooser weighs micro-batches against
# checkpointing wherever both fit.


def micro_batch_ratio(speed: Speed, micro_batches: int) -> float | None:
    """The step's seconds in ``micro_batches`` over whole: measured, or between the counts
    measured linear in k (a part's ``a + b * rows`` per call makes k calls cost ``k * a + b *
    rows``), on from the last two beyond them (None: none measured).

    Example:
        >>> sp = Speed(micro_batches=[2, 8], micro_batch_ratios=[1.5, 3.0])
        >>> [micro_batch_ratio(sp, k) for k in (1, 2, 4, 8)]
        [1.0, 1.5, 2.0, 3.0]
    """
    if not speed.micro_batches or micro_batches <= 1:
        return None if not speed.micro_batches else 1.0
    points = sorted([(1, 1.0), *zip(speed.micro_batches, speed.micro_batch_ratios, strict=True)])
    pairs = list(itertools.pairwise(points))
    (k0, r0), (k1, r1) = next(((a, b) for a, b in pairs if micro_batches <= b[0]), pairs[-1])
    return r0 + (micro_batches - k0) * (r1 - r0) / (k1 - k0)


def _ops_share(profile: Profile, part: BlockStats) -> float:
    """The share of a part's counted forward work that is ops dispatched (before scaling)."""
    work = forward_work(profile, part)
    sp = profile.speed
    return part.forward_ops * sp.op_seconds / work if sp is not None and work > 0 else 0.0


def call_seconds(profile: Profile, part: BlockStats, micro_batches: int) -> float:
    """Seconds ``micro_batches`` add to ``part``'s forward and backward over one run whole (its
    recompute aside). See Note [what a micro-batch costs]."""
    sp = profile.speed
    if sp is None or micro_batches <= 1:
        return 0.0
    whole = (sp.forward_scale + sp.backward_scale) * forward_work(profile, part)
    dispatched = (micro_batches - 1) * _ops_share(profile, part)  # every op again: the least
    ratio = micro_batch_ratio(sp, micro_batches)
    added = dispatched if ratio is None else max(dispatched, ratio - 1)
    return whole * min(micro_batches - 1, added)


def micro_batch_seconds(profile: Profile, chosen: Sequence[Option], micro_batches: int) -> float:
    """Seconds ``micro_batches`` parts add to a step over one (See Note [what a micro-batch costs]).

    Example:
        >>> from memfit.records import BlockStats, Profile, Speed
        >>> b = BlockStats("b0", saved_bytes={"none": 1}, backward_peak_bytes={"none": 1},
        ...                forward_ops=10, forward_flops=90)
        >>> sp = Speed(flop_seconds=1.0, op_seconds=1.0, byte_seconds=0.01, forward_scale=1.0,
        ...            backward_scale=2.0, timed_block="b0", micro_batches=[4], micro_batch_ratios=[1.6])
        >>> prof = Profile("fp32", "cpu", 4, [b], BlockStats("outside"), 0, 100, 0, 0, speed=sp)
        >>> round(micro_batch_seconds(prof, tiling(prof, "none"), 4), 6)  # 0.6 x 300 s + 3 x 300 B
        189.0
        >>> sp.micro_batches, sp.micro_batch_ratios = [], []  # not timed: 3 x 30 s of ops
        >>> round(micro_batch_seconds(prof, tiling(prof, "none"), 4), 6)
        99.0
    """
    sp = profile.speed
    if micro_batches <= 1 or sp is None:
        return 0.0
    forward_share = sp.forward_scale / max(1e-30, sp.forward_scale + sp.backward_scale)
    added = call_seconds(profile, profile.outside, micro_batches)
    for o in chosen:
        again = forward_share if o.segment or o.mode != "none" else 0.0
        blocks = profile.blocks[o.first : o.last + 1]
        added += (1 + again) * sum(call_seconds(profile, b, micro_batches) for b in blocks)
    accumulate = 3 * profile.grad_bytes * sp.byte_seconds
    return added + (micro_batches - 1) * accumulate


def predict_options_seconds(profile: Profile, chosen: Sequence[Option], micro_batches: int = 1) -> float:
    """Predicted seconds of one step for a plan given as options (see :func:`predict_step_seconds`)."""
    s = micro_batch_scale(profile.batch_size, micro_batches) * micro_batches
    per = [block_seconds(b, recompute_scale(profile)) for b in profile.blocks]
    plain = sum(t[block_options(b)[0]] for t, b in zip(per, profile.blocks, strict=True))
    rest = max(0.0, profile.step_seconds - plain)
    blocks = s * sum(option_seconds(profile, o, per) for o in chosen)
    return rest + blocks + micro_batch_seconds(profile, chosen, micro_batches)


def predict_step_seconds(
    profile: Profile,
    modes: str | Mapping[str, str] | Sequence[str],
    micro_batches: int = 1,
    segments: Segments = (),
) -> float:
    """Predicted seconds of one step: block times per option plus the rest of the step.

    The rest (outside the blocks, the optimizer) is the profile's measured step time less
    its blocks' no-checkpointing times; micro-batching keeps the total compute (the parts
    add up to the batch) but pays every part's fixed cost per call again in each one
    (See Note [what a micro-batch costs]).
    """
    return predict_options_seconds(profile, tiling(profile, modes, segments), micro_batches)


def time_note(profile: Profile) -> str:
    """One sentence: what the profile's step-time model rests on."""
    sp = profile.speed
    if sp is None:
        return "step times are the profile's recorded block times (no time model)."
    return (
        f"step time model ({profile.precision}): each block's forward counted as FlopCounterMode FLOPs "
        f"at {sp.flop_seconds * 1e12:.3g} s/TFLOP, bytes written (MemTracker) at "
        f"{sp.byte_seconds * 1e9:.3g} s/GB and aten ops at {sp.op_seconds * 1e6:.3g} us each "
        f"(micro-benchmarks on {profile.device}); the whole step ran {sp.forward_scale:.3g}x (forward) and "
        f"{sp.backward_scale:.3g}x (backward) as long as those counts predict, so every prediction is "
        f"scaled by that (fitted to {sp.timed_steps} timed steps"
        + (f" {sp.timed_as}" if sp.timed_as else "")
        + ")"
        + (
            f", a recompute at x{sp.recompute_scale:.3g} of that forward (fitted to {sp.timed_block} run "
            f"alone {sp.full_steps} times with and without checkpointing)"
            if sp.full_steps
            else ""
        )
        + "; a checkpoint call "
        f"{sp.checkpoint_seconds * 1e6:.3g} us, selective checkpointing "
        f"{sp.selective_op_seconds * 1e6:.3g} us per op"
        + (f" (fitted to {sp.timed_block} run alone {sp.selective_steps} times)" * bool(sp.selective_steps))
        + _micro_note(sp)
        + _spread_note(sp)
        + "."
    )


def _spread_note(sp: Speed) -> str:
    per_mode = ", ".join(f"{m} ±{v:.0%}" for m, v in sp.spreads.items())
    spread = f"; the rounds those prices were fitted to spread ±{sp.spread:.0%}" if sp.spread else ""
    spread += f" ({per_mode})" if spread and len(sp.spreads) > 1 else ""
    return spread + (f"; the machine moved a time by ±{sp.noise:.0%} while profiling" if sp.noise else "")


def _micro_note(sp: Speed) -> str:
    if not sp.micro_batches:
        return "; micro-batches priced by their counted ops (not measured)"
    measured = ", ".join(
        f"{r:.2f}x in {k}" for k, r in zip(sp.micro_batches, sp.micro_batch_ratios, strict=True)
    )
    return f"; the step's forward and backward ran {measured} micro-batches of their time whole"
