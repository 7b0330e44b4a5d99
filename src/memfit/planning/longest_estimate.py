"""The longest sequence whose training step fits a device's memory, estimated on fake tensors for
each lever tier: ``memfit estimate --maximize seq_len``.

For a model too large to run here (Llama 3.1 8B's shape on a laptop), the question "how long a
context can I train on this card?" is answered by :func:`memfit.estimate` at a few lengths:
each probe builds the model and runs its step under ``FakeTensorMode`` (nothing of the model is
allocated) at the batch's rows with the sequence grown
(:func:`memfit.planning.longest_sequence.resize_sequence`). At each length, three tiers are
predicted from the same profiles (See Note [a tier's smallest step]): no levers; the allowed
levers but ``offload``; and, where ``offload`` is allowed, all of them. Lengths are multiples of
a grain (1,024 tokens by default); the search gallops up from one grain by doubling, then
bisects to neighbours, and all tiers share its probes (:class:`SequenceSearch` also shares them
between device memories). The answer of each tier fits, one grain more does not, per the
estimate; a position table (:func:`memfit.planning.longest_sequence.position_limit`) or a cap
asked for ends the search earlier.

Refused in one sentence: a batch without ``[batch, sequence]`` token ids, a grain or cap that is
not a whole number of tokens, a position table shorter than one grain, a device memory below the
smallest step at one grain (:class:`memfit.errors.InfeasibleBudget`).

Trade-off: estimates, not measurements (fake CPU tensors under MemTracker's accounting: no CUDA
allocator rounding, workspaces or context); each probe costs one fake step per precision and
checkpointing mode plus the levers' facts, which for an 8B model is tens of seconds, so the
search is in grains rather than tokens.

Example:
    >>> import torch
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> x = torch.randint(0, 256, (1, 32))
    >>> found = longest_estimate(lambda: GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=1024)),
    ...     (x, x), gpt_loss, lambda p: torch.optim.AdamW(p), device_memory="2MiB", precisions=["fp32"],
    ...     grain=128)
    >>> a = found.answers[0]
    >>> 0 < a.tokens < 1024 and a.peak_bytes <= found.device_memory < a.next_peak_bytes
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit import progress
from memfit.applying.offload import OFFLOAD
from memfit.applying.registry import lever, lever_sets, normalize_levers, usable_levers
from memfit.budget import format_bytes, parse_bytes
from memfit.errors import ConfigError, InfeasibleBudget
from memfit.measuring.estimate import estimate
from memfit.measuring.fakebuild import build_fake
from memfit.planning.longest_sequence import most_saving, position_limit, resize_sequence, sequence_length
from memfit.records import Estimate, Profile
from memfit.records.long_context import HostLinkFacts, LongestAnswer, LongestEstimate
from memfit.step import Batch, LossFn, batch_size
from memfit.stepmodel import events, simulate, tiling
from memfit.stepmodel.offload import moved_bytes, offload_price
from memfit.vocab import PRECISIONS, PrecisionName

__all__ = ["DEFAULT_GRAIN", "SequenceSearch", "TierStep", "check_grain", "longest_estimate"]

#: Lengths searched are multiples of this many tokens unless a grain is given.
DEFAULT_GRAIN = 1024
#: The longest sequence searched where nothing else stops the search.
_LONGEST = 1 << 24
#: Offload's device bytes do not depend on the link's speed; a zero speed leaves its time unpriced.
_BYTES_ONLY = HostLinkFacts("not measured: device bytes only")
#: The tiers' names, in the order the answers list them.
_TIERS = ("no levers", "levers", "levers and offload")


@dataclass(frozen=True)
class TierStep:
    """One predicted step: a lever set, precision and uniform mode, its peak split by role (the
    smallest of a tier at a length: :meth:`SequenceSearch.at`)."""

    peak: int
    levers: list[str]
    precision: str
    mode: str
    breakdown: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    event: str = ""
    """Where in the step the peak is (the step model's event)."""


# Note [a tier's smallest step]
# A tier is the levers it may use; its step at a length is the smallest over every lever set of
# those (memfit.applying.registry.lever_sets, the empty set included, so a tier with more levers
# never predicts more than one with fewer), every precision the set runs at, and every uniform
# checkpointing mode, at one micro-batch, each lever at its most saving setting (the loss head's
# smallest chunk, the tiled MLP's most chunks). Without levers, the step is the estimate's own
# entry (what `memfit estimate` prints at that length: a tracked fake step where the blocks
# differ or are few); with levers, the step model's prediction from the same profile. offload is
# priced over the step's events with every block's checkpointed input (or kept bytes) in host
# memory (memfit.stepmodel.offload): the device bytes need no link speed, so none is assumed.
# The peak's split by role under offload is the same event's without it, less what is off the
# device then, taken from the activations.


def check_grain(grain: int, max_seq_len: int | None = None) -> None:
    """Refuse a grain or a cap that is not a whole number of tokens (the cap at least one grain).

    Example:
        >>> check_grain(1024, 4096)
    """
    if isinstance(grain, bool) or not isinstance(grain, int) or grain < 1:
        raise ConfigError(f"the grain must be a whole number of tokens, at least 1, got {grain!r}.")
    if max_seq_len is None:
        return
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < grain:
        raise ConfigError(
            f"the longest sequence to search must be a whole number of tokens, at least one grain "
            f"({grain:,}), got {max_seq_len!r}."
        )


def _offloaded(prof: Profile, mode: str, levers: Sequence[str]) -> TierStep:
    """The step at ``mode`` with every block offloaded (See Note [a tier's smallest step])."""
    chosen = tiling(prof, mode)
    evs = events(prof, 1, chosen)
    price = offload_price(prof, mode, moved_bytes(prof, mode, [b.name for b in prof.blocks]), _BYTES_ONLY)
    at = max(range(len(price.timeline)), key=lambda i: price.timeline[i][1])
    parts = evs[at].parts(chosen)
    parts["activations"] -= evs[at].value(chosen) - price.timeline[at][1]
    offloaded = normalize_levers([*levers, OFFLOAD.name])
    return TierStep(
        price.peak_bytes, offloaded, prof.precision, mode, parts, price.host_bytes, price.peak_event
    )


def _candidates(est: Estimate, usable: Sequence[str], offload: bool) -> Iterator[TierStep]:
    """Every lever set's step of ``usable`` at every precision and uniform mode (and offloaded);
    without levers, the estimate's own entries (See Note [a tier's smallest step])."""
    for e in est.entries:  # the step model names the event (the entry's peak is a tracked step's)
        event = simulate(est.profiles[e.precision], e.mode).peak_event if e.precision in est.profiles else ""
        yield TierStep(e.peak_bytes, [], e.precision, e.mode, dict(e.breakdown), event=event)
    for levers in lever_sets(usable) if usable else [[]]:
        for precision, prof in est.profiles.items():
            if not all(lever(n).runs_at(precision) for n in levers):
                continue
            under = most_saving(prof, levers)
            for mode in sorted({m for b in under.blocks for m in b.saved_bytes} or {"none"}):
                if levers:
                    sim = simulate(under, mode)
                    parts = dict(sim.breakdown)
                    yield TierStep(sim.peak_bytes, list(levers), precision, mode, parts, event=sim.peak_event)
                if offload and under.blocks:
                    yield _offloaded(under, mode, levers)


class SequenceSearch:
    """The probes of one model and batch, each length's smallest step per tier kept, so that the
    answers for several device memories share them (:func:`longest_estimate` asks one).

    Raises:
        ConfigError: no ``[batch, sequence]`` token ids, a bad grain or cap, a position table
            shorter than one grain, an unknown lever (and what :func:`memfit.estimate` refuses).
    """

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        batch: Batch,
        loss_fn: LossFn,
        optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
        precisions: Iterable[PrecisionName | str] = PRECISIONS,
        levers: str | Iterable[str] | None = None,
        grain: int = DEFAULT_GRAIN,
        max_seq_len: int | None = None,
    ) -> None:
        check_grain(grain, max_seq_len)
        sequence_length(batch, remedy="estimate it at its own shape instead")
        self.model_fn, self.given, self.loss_fn, self.optimizer_fn = model_fn, batch, loss_fn, optimizer_fn
        self.precisions, self.grain = list(precisions), grain
        allowed = normalize_levers(levers)
        others = [n for n in allowed if n != OFFLOAD.name and lever(n).planned]
        tiers = [[], others, normalize_levers([*others, OFFLOAD.name])]
        kept = [True, bool(others), OFFLOAD.name in allowed]
        self.tiers = {name: t for name, t, keep in zip(_TIERS, tiers, kept, strict=True) if keep}
        self.longest, self.limit = self._longest(max_seq_len)
        self.steps: dict[int, dict[str, TierStep]] = {}
        """Grains -> tier -> the smallest step there."""
        self.seconds: dict[int, float] = {}
        self.refused: dict[str, str] = {}
        self.last: Estimate | None = None

    def _longest(self, cap: int | None) -> tuple[int, str]:
        """The longest length searched (a multiple of the grain) and what fixes it ("": nothing)."""
        model = build_fake(FakeTensorMode(), self.model_fn).model
        found = position_limit(model)
        limits = [(_LONGEST, "")]
        limits += [(found[0], found[1])] if found is not None else []
        limits += [(cap, f"the cap of {cap:,} tokens asked for")] if cap is not None else []
        tokens, why = min(limits)
        if tokens < self.grain:
            raise ConfigError(
                f"{type(model).__name__} takes at most {tokens:,} tokens ({why}), less than one grain of "
                f"{self.grain:,}: give a grain of at most {tokens:,} tokens."
            )
        return tokens // self.grain * self.grain, why

    def at(self, grains: int) -> dict[str, TierStep]:
        """Each tier's smallest step at ``grains`` grains, estimated once.

        See Note [a tier's smallest step].
        """
        if grains not in self.steps:
            started = time.perf_counter()
            others = self.tiers.get("levers", [])
            est = estimate(
                self.model_fn, resize_sequence(self.given, grains * self.grain), self.loss_fn,
                self.optimizer_fn, precisions=self.precisions, levers=others or False,
            )  # fmt: skip
            usable, refused = usable_levers(est.profiles, others)
            self.refused.update(refused)
            found = list(_candidates(est, usable, "levers and offload" in self.tiers))
            self.steps[grains] = {
                tier: min((s for s in found if set(s.levers) <= set(allowed)), key=lambda s: s.peak)
                for tier, allowed in self.tiers.items()
            }
            self.last, self.seconds[grains] = est, time.perf_counter() - started
            peaks = ", ".join(f"{t} {format_bytes(s.peak)}" for t, s in self.steps[grains].items())
            progress.note(f"{grains * self.grain:,} tokens: {peaks} ({self.seconds[grains]:.0f} s)")
        return self.steps[grains]

    def _bracket(self, tier: str, memory: int) -> tuple[int, int | None]:
        """The most grains ``tier`` fits (0: none) and one more (None: the longest searched fits):
        gallop up by doubling from the longest that fits, then bisect."""
        top = self.longest // self.grain
        while True:
            fits = {k: steps[tier].peak <= memory for k, steps in self.steps.items()}
            lo = max((k for k, ok in fits.items() if ok), default=0)
            hi = min((k for k, ok in fits.items() if not ok and k > lo), default=None)
            if lo == top:
                return lo, None
            if hi == lo + 1:
                return lo, hi
            self.at((lo + hi) // 2 if hi is not None else min(max(2 * lo, 1), top))

    def _answer(self, tier: str, memory: int) -> LongestAnswer:
        lo, hi = self._bracket(tier, memory)
        at = self.steps[lo][tier] if lo else TierStep(0, [], "", "")
        return LongestAnswer(
            tier=tier, allowed=list(self.tiers[tier]), tokens=lo * self.grain, levers=at.levers,
            precision=at.precision, mode=at.mode, peak_bytes=at.peak, breakdown=dict(at.breakdown),
            host_bytes=at.host_bytes, event=at.event, next_tokens=hi * self.grain if hi else 0,
            next_peak_bytes=self.steps[hi][tier].peak if hi else 0, limit="" if hi else self.limit,
        )  # fmt: skip

    def longest_sequence(self, device_memory: int | str) -> LongestEstimate:
        """The longest sequence each tier fits in ``device_memory`` ("24GiB", bytes).

        Raises:
            ConfigError: a bad ``device_memory``.
            InfeasibleBudget: no tier fits even one grain (the message names the smallest step).
        """
        memory = parse_bytes(device_memory, what="device memory")
        answers = [self._answer(tier, memory) for tier in self.tiers]
        if not any(a.tokens for a in answers):
            self._refuse(memory)
        est = self.last
        assert est is not None
        probes = [k * self.grain for k in self.seconds]
        return LongestEstimate(
            model=est.model, param_count=est.param_count, batch_size=batch_size(self.given),
            optimizer=est.optimizer, device_memory=memory, grain=self.grain, answers=answers,
            longest=self.longest, probes=probes, probe_seconds=list(self.seconds.values()),
            refused=dict(self.refused), assumptions=[*est.assumptions, *self._assumptions()],
        )  # fmt: skip

    def _assumptions(self) -> list[str]:
        return [
            f"Lengths are multiples of {self.grain:,} tokens; each tier's step is the smallest over its "
            "lever sets, precisions and one checkpointing mode for every block, at one micro-batch, each "
            "lever at its most saving setting.",
            *(
                ["offload: every block's checkpointed input (or kept bytes) in pinned host memory; the "
                 "device bytes need no link speed, the copies' time is not priced."]
                if "levers and offload" in self.tiers else []
            ),
        ]  # fmt: skip

    def _refuse(self, memory: int) -> None:
        least = self.steps[1][list(self.tiers)[-1]]
        using = f"with levers {', '.join(least.levers)}" if least.levers else "without levers"
        more = "" if least.levers else ", allow levers"
        raise InfeasibleBudget(
            f"not even one grain of {self.grain:,} tokens fits in {format_bytes(memory)}: the smallest "
            f"predicted step there is {format_bytes(least.peak)} ({using}, {least.precision}, {least.mode} "
            f"checkpointing); raise the device memory{more} or give a smaller grain.",
            minimum_bytes=least.peak,
            budget_bytes=memory,
        )


def longest_estimate(
    model_fn: Callable[[], nn.Module],
    batch: Batch,
    loss_fn: LossFn,
    optimizer_fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    *,
    device_memory: int | str,
    precisions: Iterable[PrecisionName | str] = PRECISIONS,
    levers: str | Iterable[str] | None = None,
    grain: int = DEFAULT_GRAIN,
    max_seq_len: int | None = None,
) -> LongestEstimate:
    """The longest sequence (a multiple of ``grain``) whose smallest predicted step fits
    ``device_memory``, for each lever tier, on fake tensors only.

    Args:
        model_fn, batch, loss_fn, optimizer_fn, precisions: as :func:`memfit.estimate`; the
            batch's ``[batch, sequence]`` integer tensors are grown along dimension 1.
        device_memory: bytes the step must fit ("24GiB", "80GB", int).
        levers: the levers allowed (names, a comma-separated string or "all"; None: none). The
            tiers are no levers, these but ``offload``, and all of them where ``offload`` is one.
        grain: lengths searched are multiples of it (tokens).
        max_seq_len: the longest length searched (None: up to the model's position table, if any).

    Returns:
        A :class:`memfit.records.long_context.LongestEstimate`, one answer per tier.

    Raises:
        ConfigError: see :class:`SequenceSearch`; a bad ``device_memory``.
        InfeasibleBudget: no tier fits one grain (the smallest step named).
    """
    search = SequenceSearch(model_fn, batch, loss_fn, optimizer_fn, precisions, levers, grain, max_seq_len)
    return search.longest_sequence(device_memory)
