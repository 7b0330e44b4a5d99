"""The one model of a training step's cost: memory events by role, and step time.

A :class:`memfit.Profile` holds per-block numbers each measured with every block in one
mode; a plan mixes modes. This module walks the step as events (each block's forward, the
head and loss, each block's backward in reverse order, the optimizer step) and adds up, at
each event, what is held, split by role: parameters, gradients accumulated so far,
optimizer state, activations still kept by the blocks not yet back-propagated, and the
transient bytes of the work running then (a block's backward with its recompute). The
peak is the largest event. Each event is linear in the per-block choices, so the solver
(:mod:`memfit.planning.solver`) constrains exactly the expressions :func:`simulate`
evaluates, and ``memfit profile``, ``memfit estimate`` and ``memfit plan`` all report
peaks from this one model.

Trade-off: it is a model of the step, not a replay: it treats blocks as additive (a block's
kept bytes do not depend on its neighbours' modes). That is exact for chains of blocks and
close where tensors are held across blocks (U-Net skips); :func:`memfit.plan` measures the
chosen plan once to catch the rest.

Example:
    >>> from memfit.records import BlockStats, Profile
    >>> blk = BlockStats("b0", param_bytes=10, grad_bytes=10, saved_bytes={"none": 100, "full": 10},
    ...                  backward_peak_bytes={"none": 50, "full": 150})
    >>> prof = Profile(precision="fp32", device="cpu", batch_size=2, blocks=[blk],
    ...                outside=BlockStats("outside"), param_bytes=10, grad_bytes=10,
    ...                optimizer_bytes=20, optimizer_temp_bytes=10)
    >>> simulate(prof, {"b0": "none"}).peak_bytes
    180
    >>> sim = simulate(prof, "full")
    >>> sim.peak_bytes, sim.peak_event, sim.breakdown["temporaries"]
    (190, 'backward of b0', 150)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from memfit.errors import ConfigError
from memfit.records import BREAKDOWN_KEYS, BlockStats, Profile
from memfit.vocab import CHECKPOINT_MODES, normalize_mode

__all__ = [
    "Event",
    "Simulation",
    "block_options",
    "block_seconds",
    "events",
    "micro_batch_scale",
    "normalize_modes",
    "predict_step_seconds",
    "simulate",
]

#: Bytes per role (:data:`memfit.records.BREAKDOWN_KEYS`); roles not named hold nothing.
Parts = Mapping[str, int]


@dataclass(frozen=True)
class Event:
    """One moment of the step: ``fixed`` bytes plus, per block, its bytes in its chosen mode.

    Both are split by role (params, grads, optimizer, activations, temporaries); blocks
    absent from ``blocks`` add nothing. :attr:`const` and :attr:`coef` are the same numbers
    summed over roles: the linear expression the solver constrains.
    """

    label: str
    fixed: Parts
    """Bytes held at this moment whatever the plan, by role."""
    blocks: Mapping[int, Mapping[str, Parts]] = field(default_factory=dict)
    """Block index -> mode -> bytes by role that the block adds at this moment."""

    @property
    def const(self) -> int:
        """``fixed`` summed over roles."""
        return sum(self.fixed.values())

    @functools.cached_property
    def coef(self) -> dict[int, dict[str, int]]:
        """Block index -> mode -> bytes (summed over roles)."""
        return {i: {m: sum(parts.values()) for m, parts in per.items()} for i, per in self.blocks.items()}

    def parts(self, modes: Sequence[str]) -> dict[str, int]:
        """Bytes held at this event by role, when block ``i`` runs in ``modes[i]``."""
        out = {k: int(self.fixed.get(k, 0)) for k in BREAKDOWN_KEYS}
        for i, per in self.blocks.items():
            for role, n in per[modes[i]].items():
                out[role] += n
        return out

    def value(self, modes: Sequence[str]) -> int:
        """Bytes held at this event when block ``i`` runs in ``modes[i]``."""
        return self.const + sum(c[modes[i]] for i, c in self.coef.items())


@dataclass
class Simulation:
    """A predicted step: its peak, where it happens, its split by role, and every event's bytes."""

    peak_bytes: int
    peak_event: str
    timeline: list[tuple[str, int]]
    fixed_bytes: int
    """Parameters + gradients + optimizer state + optimizer temporaries: no plan removes these."""
    breakdown: dict[str, int] = field(default_factory=dict)
    """The peak split into :data:`memfit.records.BREAKDOWN_KEYS`; adds up to ``peak_bytes``."""


def normalize_modes(profile: Profile, modes: str | Mapping[str, str] | Sequence[str]) -> list[str]:
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
    out: list[str] = [normalize_mode(m) for m in seq]
    for block, mode in zip(profile.blocks, out, strict=True):
        if mode not in block_options(block):
            raise ConfigError(
                f"block {block.name!r} has no profiled mode {mode!r}; it has {block_options(block)}."
            )
    return out


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


def _scaled(value: int, s: float, unscaled: int = 0) -> int:
    """``value`` at micro-batch scale ``s``, of which ``unscaled`` bytes do not shrink."""
    keep = max(0, min(unscaled, value))
    return round(s * (value - keep)) + keep


def _block_grad_bytes(block: BlockStats) -> int:
    return block.grad_bytes or block.param_bytes


def events(profile: Profile, micro_batches: int = 1) -> list[Event]:
    """The step's memory events for ``micro_batches`` micro-batches, as linear expressions.

    The events are those of :class:`memfit.Profile`'s docstring: each block's forward and
    backward, the forward and backward outside the blocks, the optimizer step. With
    micro-batches, activations and transients scale with the (largest) part; gradients,
    the batch itself (split into views, its storage stays whole) and parameter-gradient
    temporaries do not.

    Args:
        profile: measured per-block costs at one precision.
        micro_batches: the batch is split into this many parts with gradient accumulation.

    Returns:
        Events in step order: the first micro-batch's (gradients still building up), then,
        when there are more, a later micro-batch's (all gradients already held), then the
        optimizer step.
    """
    s = micro_batch_scale(profile.batch_size, micro_batches)
    out = profile.outside
    state = {"params": profile.param_bytes, "optimizer": profile.optimizer_bytes}
    # NOTE: split into micro-batches, the batch's tensors are chunked into views inside the
    # step; MemTracker then counts their whole storage, for the rest of the step.
    whole_input = profile.input_bytes if micro_batches > 1 else 0
    before = _scaled(profile.outside_before_bytes, s)
    kept_before = _scaled(profile.outside_before_kept_bytes or profile.outside_before_bytes, s)
    early = profile.early_grad_bytes
    # NOTE: the outside's numbers were measured with every block in one mode; they barely
    # depend on it (the tests find them equal), and the largest keeps mixed plans safe.
    out_fwd = _scaled(max(out.forward_peak_bytes.values(), default=0), s)
    out_bwd = _scaled(max(out.backward_peak_bytes.values(), default=0), s, early)
    n = len(profile.blocks)
    pairs = [(b, block_options(b)) for b in profile.blocks]
    saved = [{m: round(s * b.saved_bytes[m]) for m in o} for b, o in pairs]
    # NOTE: during the forward a block holds its saved bytes plus what only the forward's end
    # frees (autocast's cached weight casts): ``held_bytes``; the backward sees ``saved``.
    held = [{m: round(s * b.held_bytes.get(m, b.saved_bytes[m])) for m in o} for b, o in pairs]
    # NOTE: FSDP2's gathered parameters (``*_fixed_bytes``) do not shrink with micro-batches.
    fwd = [
        {m: _scaled(b.forward_peak_bytes.get(m, b.saved_bytes[m]), s, b.forward_fixed_bytes) for m in o}
        for b, o in pairs
    ]
    bwd = [
        {m: _scaled(b.backward_peak_bytes[m], s, _block_grad_bytes(b) + b.backward_fixed_bytes) for m in o}
        for b, o in pairs
    ]

    def acts(per_mode: dict[str, int]) -> dict[str, Parts]:
        return {m: {"activations": v} for m, v in per_mode.items()}

    def temps(per_mode: dict[str, int]) -> dict[str, Parts]:
        return {m: {"temporaries": v} for m, v in per_mode.items()}

    result: list[Event] = []
    phases = (
        [("", False)]
        if micro_batches == 1
        else [("first micro-batch: ", False), ("later micro-batch: ", True)]
    )
    for prefix, later in phases:
        start = {**state, "grads": profile.grad_bytes if later else 0}
        for i, block in enumerate(profile.blocks):
            per: dict[int, Mapping[str, Parts]] = {j: acts(held[j]) for j in range(i)}
            per[i] = temps(fwd[i])
            fixed = {**start, "activations": whole_input + before}
            result.append(Event(f"{prefix}forward of {block.name}", fixed, per))
        all_held = {j: acts(held[j]) for j in range(n)}
        all_saved = {j: acts(saved[j]) for j in range(n)}
        fixed = {**start, "activations": whole_input, "temporaries": out_fwd}
        result.append(Event(f"{prefix}forward outside the blocks (head, loss)", fixed, all_held))
        fixed = {**start, "activations": whole_input, "temporaries": out_bwd}
        result.append(Event(f"{prefix}backward outside the blocks (loss, head)", fixed, all_saved))
        grads = profile.grad_bytes if later else early
        for i in reversed(range(n)):
            per = {j: acts(saved[j]) for j in range(i)}
            per[i] = {m: {"activations": saved[i][m], "temporaries": bwd[i][m]} for m in saved[i]}
            block = profile.blocks[i]
            fixed = {**state, "grads": grads, "activations": whole_input + kept_before}
            result.append(Event(f"{prefix}backward of {block.name}", fixed, per))
            if not later:
                grads += _block_grad_bytes(block)
        # NOTE: then the part before the blocks (stem, embeddings) runs its backward, with every
        # block's gradient held, creating its own gradients (which a later micro-batch has).
        created = max(0, profile.grad_bytes - early - sum(_block_grad_bytes(b) for b in profile.blocks))
        created = min(created, profile.outside_before_backward_bytes)
        rest = _scaled(profile.outside_before_backward_bytes - created, s)
        fixed = {**state, "grads": grads + (0 if later else created), "activations": whole_input}
        result.append(
            Event(f"{prefix}backward outside the blocks (stem, embeddings)", {**fixed, "temporaries": rest})
        )
    last = {**state, "grads": profile.grad_bytes, "activations": whole_input}
    result.append(Event("optimizer step", {**last, "temporaries": profile.optimizer_temp_bytes}))
    return result


def simulate(
    profile: Profile, modes: str | Mapping[str, str] | Sequence[str], micro_batches: int = 1
) -> Simulation:
    """Predict the step's peak bytes, and its split by role, for the given per-block modes.

    Args:
        profile: measured (or estimated) per-block costs at the precision the plan uses.
        modes: one mode for every block, ``{block name: mode}`` or a list in block order;
            modes are ``none``, ``selective`` or ``full`` (``keep`` reads as ``none``).
        micro_batches: number of gradient-accumulation micro-batches.

    Returns:
        A :class:`Simulation` with the peak, the event where it happens, the breakdown at
        the peak and the timeline.
    """
    seq = normalize_modes(profile, modes)
    evs = events(profile, micro_batches)
    timeline = [(e.label, e.value(seq)) for e in evs]
    at = max(range(len(evs)), key=lambda k: timeline[k][1])
    label, peak = timeline[at]
    fixed = profile.param_bytes + profile.grad_bytes + profile.optimizer_bytes + profile.optimizer_temp_bytes
    return Simulation(
        peak_bytes=peak, peak_event=label, timeline=timeline, fixed_bytes=fixed, breakdown=evs[at].parts(seq)
    )


def block_seconds(block: BlockStats) -> dict[str, float]:
    """Forward + backward seconds per mode; a mode costs at least keeping plus its recompute.

    # NOTE: timings on a shared machine are noisy, and a measured recompute can come out as
    # fast as keeping the activations; the planner would then checkpoint for nothing. FLOPs
    # are exact, so each mode costs at least the "none" time plus its extra FLOPs (the
    # recompute) at the block's own forward speed. Selective and full are not ordered beyond
    # that: on a CPU the selective-checkpoint dispatch overhead can make selective slower.
    """
    options = block_options(block)
    total = {m: block.forward_seconds + block.backward_seconds.get(m, 0.0) for m in options}
    floor = total[options[0]]
    base_flops = block.backward_flops.get(options[0], 0)
    speed = block.forward_seconds / block.forward_flops if block.forward_flops > 0 else 0.0
    out = {}
    for m, t in total.items():
        recompute = max(0, block.backward_flops.get(m, 0) - base_flops) * speed
        out[m] = max(t, floor + recompute)
    return out


def predict_step_seconds(
    profile: Profile, modes: Mapping[str, str] | Sequence[str], micro_batches: int = 1
) -> float:
    """Predicted seconds of one step: block times per mode plus the rest of the step.

    The rest (outside the blocks, the optimizer) is the profile's measured step time less
    its blocks' no-checkpointing times; micro-batching keeps the total compute (the parts
    add up to the batch), so only the rounding of uneven parts changes it.
    """
    seq = normalize_modes(profile, modes)
    s = micro_batch_scale(profile.batch_size, micro_batches) * micro_batches
    per_block = [block_seconds(b) for b in profile.blocks]
    plain = sum(t[block_options(b)[0]] for t, b in zip(per_block, profile.blocks, strict=True))
    rest = max(0.0, profile.step_seconds - plain)
    chosen = sum(t[m] for t, m in zip(per_block, seq, strict=True))
    return rest + s * chosen
