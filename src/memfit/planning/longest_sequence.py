"""The longest sequence one plan fits: ``memfit.plan(..., maximize="seq_len")``.

The search (:func:`longest_sequence`) keeps the batch's rows and grows (or shrinks) its
sequence: dimension 1 of each integer tensor of the batch (token ids, labels), the tokens
repeated or cut (:func:`resize_sequence`). Each probe measures every checkpointing mode's
memory on a fake-tensor twin (nothing allocated, so a sequence far longer than the device
holds costs a fraction of a step and no memory), with the facts the levers need (the loss
head, the tiled MLP) measured on the twin too, and asks the planner's lever sets whether any
plan fits (See Note [what a probe asks]). It gallops up from the
batch's own length by doubling, then bisects to neighbours: the answer fits per the
estimate, one token more does not. The answer is then planned by the function ``memfit.plan``
passes in (its own planner for one batch: real steps, timed, the chosen plan measured) and
returned with ``Plan.seq_len``; where that measurement is over the budget, the search goes
lower (See Note [confirmed once for real]).

Refused in one sentence: a batch without a sequence (no 2-D integer tensor), a sequence that
cannot grow past a fixed position table (a learned position embedding, a built-in model's
``block_size``) when the batch is longer already, a model fake tensors cannot run, a budget
below the smallest step (:class:`memfit.errors.InfeasibleBudget`).

Trade-off: the probes trust the step model on fake tensors (exact where the twin runs the
kernels the device runs); only the answer is measured.

Example:
    >>> import torch
    >>> import memfit
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=512))
    >>> x = torch.randint(0, 256, (2, 16))
    >>> p = memfit.plan(model, (x, x), gpt_loss, "2MiB", precision="fp32", maximize="seq_len")
    >>> p.seq_len > 16 and p.measured_peak_bytes <= p.budget_bytes
    True
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace

import torch
from torch import nn

from memfit import progress
from memfit.applying.offload import OFFLOAD
from memfit.applying.registry import lever, lever_sets, usable_levers, with_levers
from memfit.budget import format_bytes
from memfit.errors import ConfigError, InfeasibleBudget
from memfit.levers.weights import weights_dtype
from memfit.measuring.lever_facts import head_facts, lever_facts
from memfit.measuring.long_context import host_link_facts, tiled_floor, tiled_mlp_facts
from memfit.measuring.preserve import create_optimizer_state, preserved
from memfit.measuring.profile import Profiler
from memfit.planning.offloaded import plan_offloaded
from memfit.planning.request import Request
from memfit.planning.solver import minimum_peak, solve
from memfit.precision import Precision
from memfit.records import LeverFacts, Plan, Profile
from memfit.step import Batch, batch_size
from memfit.vocab import CHECKPOINT_MODES

__all__ = ["longest_sequence", "most_saving", "position_limit", "resize_sequence", "sequence_length"]

#: ``memfit.plan``'s planner for one batch: ``plan_at(batch, budget_bytes) -> Plan``.
PlanAt = Callable[[Batch, int], Plan]
#: The longest sequence a search considers.
_LIMIT = 1 << 24
#: A search that must look again lowers its budget by at least this share of it.
RETRY_SHARE = 64
#: Names of position tables (learned absolute position embeddings).
_POSITION_TABLES = ("wpe", "pos", "position")


def _tensors(batch: Batch) -> list[torch.Tensor]:
    return [batch] if isinstance(batch, torch.Tensor) else list(batch)


def _is_tokens(t: torch.Tensor) -> bool:
    return t.ndim == 2 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def sequence_length(
    batch: Batch, remedy: str = "use maximize='batch_size' for a model without a sequence"
) -> int:
    """The batch's sequence length: dimension 1 of its first 2-D integer tensor.

    Raises:
        ConfigError: no tensor of the batch is ``[batch, sequence]`` token ids (the message
            ends with ``remedy``).

    Example:
        >>> sequence_length((torch.zeros(2, 7, dtype=torch.long), torch.zeros(2, 7, dtype=torch.long)))
        7
    """
    for t in _tensors(batch):
        if isinstance(t, torch.Tensor) and _is_tokens(t):
            return int(t.shape[1])
    shapes = ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in _tensors(batch) if isinstance(t, torch.Tensor))
    raise ConfigError(
        f"maximize='seq_len' grows the sequence of a batch of token ids ([batch, sequence] integers), but "
        f"this batch has no such tensor ({shapes}): {remedy}."
    )


def resize_sequence(batch: Batch, n: int) -> Batch:
    """``batch`` with sequences of ``n`` tokens: every 2-D integer tensor as long as the first
    one has its tokens repeated or cut; other tensors are kept.

    Example:
        >>> resize_sequence(torch.tensor([[1, 2, 3]]), 5)
        tensor([[1, 2, 3, 1, 2]])
    """
    length = sequence_length(batch)
    tensors = _tensors(batch)
    index = torch.arange(n, device=tensors[0].device) % length
    out = [t[:, index] if _is_tokens(t) and t.shape[1] == length else t for t in tensors]
    return out[0] if isinstance(batch, torch.Tensor) else type(batch)(out)


def position_limit(model: nn.Module) -> tuple[int, str] | None:
    """The longest sequence ``model`` takes, and what fixes it: a learned position table (an
    ``nn.Embedding`` named ``wpe`` or ``*pos*``/``*position*``) or a built-in model's
    ``config.block_size``; None: nothing does (rotary positions).

    Example:
        >>> from memfit.models.gpt import GPT, GPTConfig
        >>> position_limit(GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=64)))
        (64, 'its config.block_size (64)')
    """
    found: list[tuple[int, str]] = []
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1].lower()
        if isinstance(module, nn.Embedding) and any(k in last for k in _POSITION_TABLES):
            found.append((module.num_embeddings, f"its position table {name} ({module.num_embeddings} rows)"))
    size = getattr(getattr(model, "config", None), "block_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        found.append((size, f"its config.block_size ({size})"))
    return min(found) if found else None


def _base_facts(request: Request) -> LeverFacts:
    """The lever facts that do not depend on the sequence (counts, the optimizer's temporaries,
    the host link where offload may be chosen)."""
    facts = lever_facts(request.model, request.optimizer, list(request.blocks))
    if OFFLOAD.name in request.levers:
        facts.host_link = host_link_facts(request.device)
    return facts


def _probe(request: Request, sized: Batch, precision: str, base: LeverFacts) -> Profile:
    """Every mode's memory at ``sized`` on a fake twin, with the levers' facts measured there."""
    r = request
    prec = Precision(precision, device=r.device)  # type: ignore[arg-type]
    with preserved(r.model, r.optimizer):
        prof = Profiler(r.model, sized, r.loss_fn, r.optimizer, prec, list(r.blocks))
        create_optimizer_state(r.model, r.optimizer)
        if prof.estimated_peak() is None or prof.twin is None:
            raise ConfigError(
                "maximize='seq_len' probes lengths on fake tensors, and this model cannot run on them "
                f"({prof.twin_error.rstrip('.')}): plan one length at a time with memfit.plan."
            )
        prof.use_estimate()
        prof.modes([m for m in CHECKPOINT_MODES if m != "none"] if prof.blocks else [])
        out = prof.result()
        twin = prof.twin
    facts = copy.deepcopy(base)
    step_levers = [n for n in r.levers if lever(n).step_facts]
    with twin.running():
        if step_levers:
            facts.head = head_facts(twin.model, twin.batch, r.loss_fn, precision)
        if "tiled_mlp" in r.levers:
            facts.tiled_mlp = tiled_mlp_facts(twin.model, twin.batch, r.loss_fn, precision, last_only=True)
    out.lever_facts, out.weights = facts, weights_dtype(r.model)
    tiled_floor(twin, r.loss_fn, prec, out, r.blocks)  # See Note [a tiled MLP in its block]
    return out


def most_saving(profile: Profile, levers: Sequence[str]) -> Profile:
    """``profile`` under ``levers``, each at the last of its settings (the fewest bytes: the
    loss head's smallest chunk, the tiled MLP's most chunks).

    Example:
        >>> from memfit.records import BlockStats
        >>> prof = Profile("fp32", "cpu", 1, [], BlockStats("outside"), 0, 0, 0, 0)
        >>> most_saving(prof, []) is prof
        True
    """
    for name in levers:
        ladder = lever(name).settings({profile.precision: profile})
        profile = lever(name).at_settings(profile, ladder[-1])
    return with_levers(profile, levers)


def _predicted(profiles: Mapping[str, Profile], allowed: Sequence[str]) -> Iterator[tuple[bool, Profile]]:
    """Every profile under every lever set (largest sets first: the likeliest to fit), and
    whether the set offloads (priced over the step: :mod:`memfit.planning.offloaded`)."""
    usable, _ = usable_levers(profiles, allowed)
    for levers in sorted(lever_sets(usable) if usable else [[]], key=len, reverse=True):
        for p, prof in profiles.items():
            if all(lever(n).runs_at(p) for n in levers):
                yield OFFLOAD.name in levers, most_saving(prof, levers)


def _fits(prof: Profile, offloads: bool, budget: int, micro: int) -> bool:
    """Whether a plan at ``micro`` micro-batches fits ``budget`` (offloading if ``offloads``)."""
    if not offloads:
        return solve(prof, budget, micro) is not None
    try:
        plan_offloaded({prof.precision: prof}, budget, (0, 0.0))
    except InfeasibleBudget:
        return False
    return True


def _least(prof: Profile, offloads: bool, rows: int) -> int:
    """The smallest predicted step (offloading if ``offloads``)."""
    plain = minimum_peak(prof, rows).peak_bytes
    if not offloads:
        return plain
    try:
        plan_offloaded({prof.precision: prof}, 0, (0, 0.0))
    except InfeasibleBudget as exc:
        return min(plain, exc.minimum_bytes)
    return 0


class _Search:
    """The probes of one search, each length's verdict kept (See Note [what a probe asks])."""

    def __init__(self, request: Request, budget_bytes: int) -> None:
        self.request, self.budget, self.asked = request, budget_bytes, budget_bytes
        self.base = _base_facts(request)
        self.rows = batch_size(request.batch)
        self.verdicts: dict[int, bool] = {}
        self._profiles: dict[int, dict[str, Profile]] = {}

    def profiles(self, n: int) -> dict[str, Profile]:
        if n not in self._profiles:
            sized, r = resize_sequence(self.request.batch, n), self.request
            self._profiles[n] = {p: _probe(r, sized, p, self.base) for p in r.precisions}
        return self._profiles[n]

    def lower(self, by: int) -> None:
        """Search again for ``by`` bytes less (See Note [confirmed once for real]); the probes'
        profiles are kept, their verdicts asked again."""
        self.budget -= by
        self.verdicts.clear()

    def fits(self, n: int) -> bool:
        if n not in self.verdicts:
            started = time.perf_counter()
            try:
                self.verdicts[n] = any(
                    _fits(prof, offloads, self.budget, k)
                    for offloads, prof in _predicted(self.profiles(n), self.request.levers)
                    for k in sorted({1, self.rows})
                )
            except torch.OutOfMemoryError:
                self.verdicts[n] = False
            verdict = "a plan fits" if self.verdicts[n] else "no plan fits"
            progress.note(f"{n:,} tokens: {verdict} ({time.perf_counter() - started:.0f} s)")
        return self.verdicts[n]

    def least(self, n: int) -> int:
        """The smallest predicted step at ``n`` tokens over lever sets and precisions."""
        profiles = _predicted(self.profiles(n), self.request.levers)
        return min(_least(prof, offloads, self.rows) for offloads, prof in profiles)


# Note [what a probe asks]
# A probe asks whether any plan fits at a length, not which is fastest: each lever set the
# planner may use (largest first), at each precision, with every lever at its last setting
# (the fewest bytes), is given to the exact solver with the budget (one plan or none), at one
# micro-batch and at one row a micro-batch. The planner's own choice among the plans that fit
# is made once, at the answer.


def _bracket(fits: Callable[[int], bool], lo: int, hi: int) -> tuple[int, int]:
    """``lo`` (fits, or 0) and ``hi`` (does not, or the limit + 1) narrowed to neighbours: gallop
    up from ``lo`` by doubling while the top is open, then bisect."""
    while hi - lo > 1:
        mid = min(2 * lo, hi - 1) if lo and hi > _LIMIT else (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, hi


def longest_sequence(request: Request, plan_at: PlanAt) -> Plan:
    """The plan for the longest sequence (at the request's batch's rows) within its budget.

    A percentage budget is taken of the fp32 no-checkpointing peak at the batch's own length.
    Returns the plan ``plan_at`` made at that length, with ``seq_len`` set; its notes say what
    one token more needs.

    Raises:
        ConfigError: no sequence, a batch longer than the position table, fake tensors refused.
        InfeasibleBudget: not even one token fits.
    """
    given = sequence_length(request.batch)
    limit = position_limit(request.model)
    if limit is not None and given > limit[0]:
        raise ConfigError(
            f"the batch's sequence of {given} tokens is longer than {type(request.model).__name__} takes: "
            f"{limit[1]} fixes it at {limit[0]}; shorten the batch."
        )
    budget_bytes = _budget_bytes(request)
    search = _Search(request, budget_bytes)
    top = (limit[0] if limit is not None else _LIMIT) + 1
    lo, hi = (given, top) if search.fits(given) else (0, given)
    while True:
        lo, hi = _bracket(search.fits, lo, hi)
        if lo < 1:
            _refuse(search)
        result = _confirmed(plan_at, request.batch, budget_bytes, lo)
        if isinstance(result, Plan):
            break
        # See Note [confirmed once for real]
        over = max(result.minimum_bytes - budget_bytes, search.budget // RETRY_SHARE)
        progress.note(f"{lo:,} tokens: no plan measured within the budget; searching again {over:,} B lower")
        search.lower(over)
        lo, hi = 0, lo
    return _answer(result, search, lo, hi, limit)


# Note [confirmed once for real]
# The answer is planned by memfit.plan's own planner at that length: real steps where they fit
# the device (on a fake twin where not), the plan chosen and measured under its checked loop.
# Where the planner finds no plan there after all (the fake twin's kernels are not the
# device's, or the best plan measured over its prediction), the search starts again below
# that length against a budget lowered by what the real step needed beyond the budget (the
# planner's smallest measured step, at least 1/RETRY_SHARE of the budget): one token lower
# would almost always fail the same way, and each try costs a real plan. The probes' profiles
# are kept, so the new bisection runs no fake step twice; the plan is still made and measured
# against the budget the user gave.


# Note [real steps within the budget]
# A search's answer (the longest sequence that fits) is a step whose plain form is over
# the budget by construction, often by many times: at 20k tokens a small Llama's plain
# step is gigabytes of logits where the budget is 512 MiB. Run for real because the
# device's room happens to hold it, it takes that memory from whatever shares the device
# and minutes per step on a CPU. So where ``Profiler.within`` is set (the request's
# ``steps_within``), the plain step over it is measured on the fake twin (exact where the
# twin runs the device's kernels), and whole steps are timed in the cheapest configuration
# under it (the plain step in micro-batches, else fully checkpointed), else with the loss
# head in chunks where the request allows chunked_loss (See Note [timing with a lever] in
# memfit/measuring/profile.py), and only then the cheapest under the room. The blocks alone
# and the plan's check run as always.


def _confirmed(plan_at: PlanAt, batch: Batch, budget_bytes: int, n: int) -> Plan | InfeasibleBudget:
    try:
        return plan_at(resize_sequence(batch, n), budget_bytes)
    except InfeasibleBudget as exc:
        return exc
    except torch.OutOfMemoryError:
        return InfeasibleBudget(f"{n:,} tokens ran out of memory", budget_bytes, budget_bytes)


def _budget_bytes(request: Request) -> int:
    if not request.budget.is_fraction:
        return request.budget_bytes(0)
    base = Profiler(request.model, request.batch, request.loss_fn, request.optimizer, Precision("fp32"))
    with preserved(request.model, request.optimizer):
        create_optimizer_state(request.model, request.optimizer)
        peak = base.estimated_peak()
    if peak is None:
        raise ConfigError(
            f"maximize='seq_len' with a budget of {request.budget} needs the step's peak on fake tensors, "
            "which this model cannot run on: give the budget in bytes."
        )
    return request.budget_bytes(peak)


def _refuse(search: _Search) -> None:
    least = search.least(1)
    lowered = search.asked - search.budget
    less = (
        f" less the {format_bytes(lowered)} a longer step measured beyond its prediction" if lowered else ""
    )
    raise InfeasibleBudget(
        f"not even a sequence of one token fits the budget of {format_bytes(search.asked)}{less}: its "
        f"smallest predicted step is {format_bytes(least)}; raise the budget.",
        minimum_bytes=least,
        budget_bytes=search.asked,
    )


def _answer(result: Plan, search: _Search, n: int, above: int, limit: tuple[int, str] | None) -> Plan:
    notes = list(result.notes)
    if limit is not None and above > limit[0]:
        notes.append(f"longest sequence: {n:,} tokens, as long as the model takes ({limit[1]})")
    elif not search.verdicts.get(above, True):
        lowered = (
            f" (the budget less {search.asked - search.budget:,} B, what a longer step measured beyond "
            "its prediction)"
            if search.budget < search.asked
            else ""
        )
        notes.append(
            f"longest sequence: {n:,} tokens; {above:,} tokens need at least {search.least(above):,} B "
            f"(predicted on fake tensors), over the budget of {search.budget:,} B{lowered}"
        )
    else:
        notes.append(f"longest sequence: {n:,} tokens; {above:,} tokens were measured over the budget")
    return replace(result, seq_len=n, report=replace(result.report, notes=notes))
