"""The step's memory as events: what is held at each moment, linear in the plan's options.

A :class:`memfit.records.Profile` holds per-block numbers each measured with every block in one
mode; a plan mixes modes and segments (:mod:`memfit.stepmodel.options`). :func:`events`
walks the step (the outside's forward before the blocks, each block's forward in the order
the blocks ran, what the outside between two blocks holds from then on, the head and loss,
their backward, each block's backward in reverse order with a segment's
recompute before its last block's, the outside's backward after the blocks, the optimizer
step) and writes, at each moment, the bytes held by role (parameters, gradients, optimizer
state, activations, temporaries) as a constant plus one term per option. The peak is the
largest event; the solver constrains exactly these expressions.

Trade-off: it is a model of the step, not a replay: blocks are additive (a block's kept
bytes do not depend on its neighbours' choices), exact for chains of blocks and close
where tensors are held across blocks (U-Net skips); :func:`memfit.plan` measures the plan
it returns to catch the rest. A segment's numbers are derived from its blocks' ``none``
and ``full`` numbers (the tests compare them with measured peaks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from memfit.records import BREAKDOWN_KEYS, BlockStats, Profile
from memfit.stepmodel.options import Option, Segments, block_options, micro_batch_scale, tiling
from memfit.vocab import MIXED_PRECISIONS

__all__ = ["Event", "Simulation", "events", "simulate"]

#: Bytes per role (:data:`memfit.records.BREAKDOWN_KEYS`); roles not named hold nothing.
Parts = Mapping[str, int]


@dataclass(frozen=True)
class Event:
    """One moment of the step: ``fixed`` bytes plus, per option chosen, the bytes it adds then.

    Both are split by role; options absent from ``options`` add nothing. :attr:`const` and
    :attr:`coef` are the same numbers summed over roles: the linear expression the solver
    constrains.
    """

    label: str
    fixed: Parts
    """Bytes held at this moment whatever the plan, by role."""
    options: Mapping[Option, Parts] = field(default_factory=dict)
    """Option -> bytes by role that it adds at this moment."""

    @property
    def const(self) -> int:
        """``fixed`` summed over roles."""
        return sum(self.fixed.values())

    @functools.cached_property
    def coef(self) -> dict[Option, int]:
        """Option -> bytes (summed over roles)."""
        return {o: sum(parts.values()) for o, parts in self.options.items()}

    def parts(self, chosen: Iterable[Option]) -> dict[str, int]:
        """Bytes held at this event by role, for the chosen options."""
        out = {k: int(self.fixed.get(k, 0)) for k in BREAKDOWN_KEYS}
        for o in chosen:
            for role, n in self.options.get(o, {}).items():
                out[role] += n
        return out

    def value(self, chosen: Iterable[Option]) -> int:
        """Bytes held at this event for the chosen options."""
        coef = self.coef
        return self.const + sum(coef.get(o, 0) for o in chosen)


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


def _scaled(value: int, s: float, unscaled: int = 0) -> int:
    """``value`` at micro-batch scale ``s``, of which ``unscaled`` bytes do not shrink."""
    keep = max(0, min(unscaled, value))
    return round(s * (value - keep)) + keep


def _grad(block: BlockStats) -> int:
    return block.grad_bytes or block.param_bytes


def _kept_before(profile: Profile) -> int:
    """What the stem keeps to the blocks' backward in the plain step (not measured: all it made)."""
    kept = profile.outside_before_kept_bytes
    return kept if kept >= 0 else profile.outside_before_bytes


class _Blocks:
    """Per-block numbers at one micro-batch scale, and each option's bytes at each moment."""

    def __init__(self, profile: Profile, s: float) -> None:
        self.n = len(profile.blocks)
        pairs = [(b, block_options(b)) for b in profile.blocks]
        self.saved = [{m: round(s * b.saved_bytes[m]) for m in o} for b, o in pairs]
        # Note [held and saved bytes]
        # During the forward a block holds its saved bytes plus what only the forward's end
        # frees (autocast's cached weight casts): ``held``; the backward sees ``saved``.
        # The weight casts are the weights' size whatever the micro-batch: they do not shrink.
        # Only autocast makes them: at fp32 there are none, and what the forward's end frees
        # shrinks with the micro-batch like the rest.
        casts = profile.precision in MIXED_PRECISIONS
        cache = [
            {
                m: max(0, b.held_bytes.get(m, b.saved_bytes[m]) - b.own_saved_bytes(m)) if casts else 0
                for m in o
            }
            for b, o in pairs
        ]
        self.held = [
            {m: _scaled(b.held_bytes.get(m, b.saved_bytes[m]), s, c[m]) for m in o}
            for (b, o), c in zip(pairs, cache, strict=True)
        ]
        # FSDP2's gathered parameters (``*_fixed_bytes``) do not shrink with micro-batches.
        self.fwd = [
            {
                m: _scaled(b.forward_peak_bytes.get(m, b.saved_bytes[m]), s, b.forward_fixed_bytes + c[m])
                for m in o
            }
            for (b, o), c in zip(pairs, cache, strict=True)
        ]
        self.bwd = [
            {m: _scaled(b.backward_peak_bytes[m], s, _grad(b) + b.backward_fixed_bytes) for m in o}
            for b, o in pairs
        ]
        self.out = [round(s * b.output_bytes) for b in profile.blocks]
        # See Note [outside between blocks] (memfit.measuring.order)
        self.between = [0]  # held by the outside code that ran between the blocks before t
        for b in profile.blocks[:-1]:
            self.between.append(self.between[-1] + round(s * b.after_held_bytes))
        self.after_grads = [b.after_grad_bytes for b in profile.blocks]
        # recomputed activations of blocks i..k-1 inside a segment: prefix[k] - prefix[i]
        self.prefix = [0]
        for k in range(self.n):
            self.prefix.append(self.prefix[-1] + self.saved[k].get("none", 0))

    def _call(self, i: int) -> int:
        """What a segment's one checkpoint call keeps besides its output (RNG state)."""
        return max(0, self.saved[i]["full"] - self.out[i])

    def _cache(self, k: int) -> int:
        return max(0, self.held[k]["full"] - self.saved[k]["full"])

    def _kept(self, o: Option) -> int:
        if not o.segment:
            return self.saved[o.first][o.mode]
        return self._call(o.first) + self.out[o.last]

    def _held(self, o: Option) -> int:
        if not o.segment:
            return self.held[o.first][o.mode]
        return self._kept(o) + sum(self._cache(k) for k in range(o.first, o.last + 1))

    def forward(self, o: Option, t: int) -> Parts:
        """While block t's forward runs."""
        i, j = o.first, o.last
        if t < i:
            return {}
        if t > j:
            return {"activations": self._held(o)}
        if not o.segment:
            return {"temporaries": self.fwd[t][o.mode]}
        if t == i:
            return {"temporaries": self.fwd[i]["full"]}
        done = self._call(i) + sum(self._cache(k) for k in range(i, t))
        # the input of block t (block t-1's output) is alive but kept by no one yet
        return {"activations": done, "temporaries": self.out[t - 1] + self.fwd[t]["full"]}

    def after_forward(self, o: Option, backward: bool) -> Parts:
        """At the head and loss: the forward's holdings, or (backward) what is kept."""
        return {"activations": self._kept(o) if backward else self._held(o)}

    def backward(self, o: Option, t: int, recompute: bool) -> Parts:
        """While block t's backward runs (``recompute``: just before, a segment recomputing)."""
        i, j = o.first, o.last
        if t < i:
            return {}
        if t > j:
            return {"activations": self._kept(o)}
        if not o.segment:
            extra = {} if recompute else {"temporaries": self.bwd[t][o.mode]}
            return {"activations": self.saved[t][o.mode], **extra}
        call = self._call(i)
        if recompute and t == j:
            # every block of the segment is recomputed now; the segment's output gradient waits
            rec = max(self.prefix[k] - self.prefix[i] + self.fwd[k]["none"] for k in range(i, j + 1))
            return {"activations": call, "temporaries": self.out[j] + rec}
        acts = call + self.prefix[t + 1] - self.prefix[i]
        return (
            {"activations": acts} if recompute else {"activations": acts, "temporaries": self.bwd[t]["none"]}
        )


@dataclass(frozen=True)
class _Walk:
    """The step's numbers at one micro-batch scale, read by every event of :func:`events`."""

    profile: Profile
    opts: list[Option]
    blk: _Blocks
    state: dict[str, int]
    """Parameters and optimizer state: held at every moment."""
    whole: int
    """The batch's whole storage, held all step once it is split (Note [micro-batch views])."""
    before: int
    kept_before: int
    early: int
    """Gradient bytes that exist when the first block's backward starts."""
    block_grads: int
    outside_grads: int
    out_fwd: int
    out_bwd: int
    stem_fwd: int
    stem_bwd: int
    step: Mapping[str, int]
    """Per block (``""``: outside), the fused optimizer step's temporaries."""

    def event(self, label: str, fixed: Parts, term: Callable[[Option], Parts]) -> Event:
        """An event whose terms are ``term(option)`` for every option that adds bytes then."""
        return Event(label, fixed, {o: p for o in self.opts if (p := term(o))})


@dataclass(frozen=True)
class _Phase:
    """One micro-batch's walk: its label, whether gradients are already held, whether it is
    the fused step's last (Note [fused step's last micro-batch])."""

    prefix: str
    later: bool
    last: bool


def _walk(profile: Profile, micro_batches: int, opts: list[Option]) -> _Walk:
    s = micro_batch_scale(profile.batch_size, micro_batches)
    out = profile.outside
    early = profile.early_grad_bytes
    block_grads = sum(_grad(b) for b in profile.blocks)
    outside_grads = max(0, profile.grad_bytes - block_grads)
    # Note [micro-batch views]
    # Split into micro-batches, the batch's tensors are chunked into views inside the step;
    # MemTracker then counts their whole storage, for the rest of the step.
    whole = profile.input_bytes if micro_batches > 1 else 0
    # The outside's numbers were measured with every block in one mode; they barely depend
    # on it (the tests find them equal), and the largest keeps mixed plans safe.
    return _Walk(
        profile=profile,
        opts=opts,
        blk=_Blocks(profile, s),
        state={"params": profile.param_bytes, "optimizer": profile.optimizer_bytes},
        whole=whole,
        before=_scaled(profile.outside_before_bytes, s),
        kept_before=_scaled(_kept_before(profile), s),
        early=early,
        block_grads=block_grads,
        outside_grads=outside_grads,
        # the chunked loss head's weight gradient (memfit.applying.chunked_loss) does not shrink
        out_fwd=_scaled(max(out.forward_peak_bytes.values(), default=0), s, out.forward_fixed_bytes),
        out_bwd=_scaled(max(out.backward_peak_bytes.values(), default=0), s, early),
        stem_fwd=_scaled(profile.outside_before_forward_peak_bytes, s),
        stem_bwd=_scaled(max(0, profile.outside_before_backward_peak_bytes - outside_grads), s),
        step=profile.lever_step_bytes,
    )


def _phases(profile: Profile, micro_batches: int) -> list[_Phase]:
    """The micro-batches the events walk: the first, a later one, the fused step's last."""
    phases = (
        [("", False)]
        if micro_batches == 1
        else [("first micro-batch: ", False), ("later micro-batch: ", True)]
    )
    # Note [fused step's last micro-batch]
    # With the optimizer step fused into the backward (memfit.levers.fused), the last
    # micro-batch's backward frees each gradient as it completes: its own phase.
    fused = "fused_step" in profile.levers
    if fused:
        phases = phases[:-1] if micro_batches <= 2 else phases
        phases.append(("last micro-batch: " if micro_batches > 1 else "", micro_batches > 1))
    return [_Phase(p, later, fused and k == len(phases) - 1) for k, (p, later) in enumerate(phases)]


def _forward_events(w: _Walk, ph: _Phase) -> list[Event]:
    """The stem's forward, each block's, then the head and loss."""
    prefix, start = ph.prefix, {**w.state, "grads": w.profile.grad_bytes if ph.later else 0}
    result: list[Event] = []
    if w.stem_fwd:
        fixed = {**start, "activations": w.whole, "temporaries": w.stem_fwd}
        result.append(Event(f"{prefix}forward outside before the blocks", fixed))
    for t, block in enumerate(w.profile.blocks):
        fixed = {**start, "activations": w.whole + w.before + w.blk.between[t]}
        label = f"{prefix}forward of {block.name}"
        result.append(w.event(label, fixed, functools.partial(w.blk.forward, t=t)))
    fixed = {**start, "activations": w.whole, "temporaries": w.out_fwd}
    label = f"{prefix}forward outside the blocks (head, loss)"
    return [*result, w.event(label, fixed, lambda o: w.blk.after_forward(o, False))]


def _head_backward_event(w: _Walk, ph: _Phase) -> Event:
    """The loss's and the head's backward, before the blocks'."""
    start = {**w.state, "grads": w.profile.grad_bytes if ph.later else 0}
    fixed = {**start, "activations": w.whole, "temporaries": w.out_bwd}
    if ph.last:  # the head's gradients step as they complete
        fixed = {
            **start,
            "grads": w.profile.grad_bytes - w.early if ph.later else 0,
            "activations": w.whole,
            "temporaries": w.out_bwd - w.early + w.step.get("", 0),
        }
    label = f"{ph.prefix}backward outside the blocks (loss, head)"
    return w.event(label, fixed, lambda o: w.blk.after_forward(o, True))


def _block_backward_events(w: _Walk, ph: _Phase) -> list[Event]:
    """Each block's backward in reverse order, a segment's recompute before its last block's."""
    prefix, later, result = ph.prefix, ph.later, []
    grads = w.profile.grad_bytes if later else w.early
    if ph.last:  # blocks not yet backwarded and the stem still hold earlier micro-batches' gradients
        grads = w.block_grads + w.outside_grads - w.early if later else 0
    segments = any(o.segment for o in w.opts)
    for t in reversed(range(w.blk.n)):
        block = w.profile.blocks[t]
        if not later and not ph.last:  # the outside code between block t and t+1 has run backward
            grads += w.blk.after_grads[t]
        fixed = {**w.state, "grads": grads, "activations": w.whole + w.kept_before}
        if segments:
            label = f"{prefix}recompute before the backward of {block.name}"
            result.append(w.event(label, fixed, functools.partial(w.blk.backward, t=t, recompute=True)))
        if ph.last:  # its new gradients step and go as they complete; one parameter's step at a time
            fixed = {**fixed, "temporaries": w.step.get(block.name, 0) - _grad(block)}
        label = f"{prefix}backward of {block.name}"
        result.append(w.event(label, fixed, functools.partial(w.blk.backward, t=t, recompute=False)))
        if ph.last:
            grads -= _grad(block) if later else 0
        elif not later:
            grads += _grad(block)
    return result


def _stem_backward_events(w: _Walk, ph: _Phase) -> list[Event]:
    """The stem's backward, after every block's (none when the stem holds nothing then)."""
    if not w.stem_bwd:
        return []
    fixed = {
        **w.state,
        "grads": w.block_grads + (w.outside_grads if ph.later else w.early),
        "activations": w.whole,
        "temporaries": w.stem_bwd,
    }
    if ph.last:
        fixed["grads"] = w.outside_grads - w.early if ph.later else 0
        fixed["temporaries"] = w.stem_bwd + w.step.get("", 0)
    return [Event(f"{ph.prefix}backward outside before the blocks", fixed)]


def events(profile: Profile, micro_batches: int = 1, options: Sequence[Option] | None = None) -> list[Event]:
    """The step's memory events for ``micro_batches`` micro-batches, as linear expressions.

    Args:
        profile: measured per-block costs at one precision.
        micro_batches: the batch is split into this many parts with gradient accumulation;
            activations and transients scale with the (largest) part; gradients, the batch
            itself (split into views, its storage stays whole) and parameter-gradient
            temporaries do not.
        options: the options to write terms for (default: every per-block mode and every
            segment, :func:`memfit.stepmodel.options.all_options`).

    Returns:
        Events in step order: the first micro-batch's (gradients still building up), then,
        when there are more, a later micro-batch's (all gradients already held), then the
        optimizer step.
    """
    from memfit.stepmodel.options import all_options

    opts = list(all_options(profile) if options is None else options)
    w = _walk(profile, micro_batches, opts)
    result: list[Event] = []
    for ph in _phases(profile, micro_batches):
        result += _forward_events(w, ph)
        result.append(_head_backward_event(w, ph))
        result += _block_backward_events(w, ph)
        result += _stem_backward_events(w, ph)
    if "fused_step" not in profile.levers:
        end = {**w.state, "grads": profile.grad_bytes, "activations": w.whole}
        result.append(Event("optimizer step", {**end, "temporaries": profile.optimizer_temp_bytes}))
    return result


def simulate(
    profile: Profile,
    modes: str | Mapping[str, str] | Sequence[str],
    micro_batches: int = 1,
    segments: Segments = (),
) -> Simulation:
    """Predict the step's peak bytes, and its split by role, for the given plan.

    Args:
        profile: measured (or estimated) per-block costs at the precision the plan uses.
        modes: one mode for every block, ``{block name: mode}`` or a list in block order;
            modes are ``none``, ``selective`` or ``full`` (``keep`` reads as ``none``).
        micro_batches: number of gradient-accumulation micro-batches.
        segments: runs of consecutive blocks checkpointed as one (block names, or
            ``(first, last)`` indices); their blocks' modes are not read.

    Returns:
        A :class:`Simulation` with the peak, the event where it happens, the breakdown at
        the peak and the timeline.
    """
    chosen = tiling(profile, modes, segments)
    evs = events(profile, micro_batches, chosen)
    return simulate_options(profile, chosen, micro_batches, evs)


def simulate_options(
    profile: Profile, chosen: Sequence[Option], micro_batches: int = 1, evs: Sequence[Event] | None = None
) -> Simulation:
    """:func:`simulate` for a plan given as options (one tiling of the blocks)."""
    evs = events(profile, micro_batches, chosen) if evs is None else evs
    timeline = [(e.label, e.value(chosen)) for e in evs]
    at = max(range(len(evs)), key=lambda k: timeline[k][1])
    label, peak = timeline[at]
    fixed = profile.param_bytes + profile.grad_bytes + profile.optimizer_bytes + profile.optimizer_temp_bytes
    return Simulation(peak, label, timeline, fixed, evs[at].parts(chosen))
