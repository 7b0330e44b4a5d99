"""What a lever is: one object that owns everything about it (:class:`Lever`).

A lever changes a training step beyond activations (the optimizer state in fewer bits, the
loss head in chunks...). Each one is a subclass of :class:`Lever` in a module of its own
(:mod:`memfit.applying.fused_step`, :mod:`memfit.applying.state`...), listed once in
:mod:`memfit.applying.registry`, and owns, in that module:

- its ``name`` and its numeric ``risk`` (the planner tries lever sets least risky first),
  the ``group`` whose levers exclude each other and the levers it ``excludes``;
- when it is refused (:meth:`Lever.refusal`: one sentence) and when its bytes cannot be
  predicted from a profile (:meth:`Lever.unpredictable`), and the precisions it runs at;
- what must be measured for it (``step_facts``: one forward of the step, beyond the counts
  and the optimizer's step every lever set gets; :mod:`memfit.measuring.lever_facts`);
- how it changes the step model's :class:`~memfit.records.Profile`
  (:meth:`Lever.predict`: pure, on a copy the registry's :func:`~memfit.applying.registry.with_levers` made);
- the settings the planner searches (:meth:`Lever.settings`, e.g. the loss head's chunk
  ladder), largest first;
- how it is applied to a model and optimizer and undone (:meth:`Lever.apply`, :meth:`Lever.clear`).

The mechanics (what a lever does to tensors and modules) stay in :mod:`memfit.levers`; a
lever object wraps them. How to add one is told in docs/ARCHITECTURE.md.

Example:
    >>> class Nothing(Lever):
    ...     name = "nothing"
    >>> Nothing().settings({}), Nothing().refusal(Site(torch.device("cpu"), "AdamW", "fp32"))
    ([{}], None)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from memfit.records import LeverFacts, Plan, Profile
from memfit.records.plan import LeverSettings

__all__ = ["Applying", "Lever", "Predict", "Predicting", "Site", "Undo"]

#: A profile under a lever set (:func:`memfit.applying.registry.with_levers`).
Predict = Callable[[Profile, Sequence[str]], Profile]


@dataclass(frozen=True)
class Site:
    """Where a lever would run: what its refusal is judged on."""

    device: torch.device
    optimizer: str
    """The optimizer's family (``AdamW``...; one memfit carried over keeps its family), ``none``."""
    precision: str
    """The precision, or ``auto`` (the planner picks among precisions)."""
    model: nn.Module | None = None
    """The model (None: judged when the lever is applied)."""


@dataclass(frozen=True)
class Predicting:
    """A lever set being predicted: what each lever's :meth:`Lever.predict` reads."""

    levers: tuple[str, ...]
    """The set, in the registry's order."""
    base: Profile
    """The profile without levers."""
    facts: LeverFacts
    weights: str
    """The floating weights' dtype name with the set (``fp32`` or ``bf16``)."""
    bf16_weights: bool
    """A lever of the set keeps the floating weights in bf16."""
    weight_bytes: int
    """Bytes per element of those weights."""
    optimizer_kind: str
    """``orig`` (the user's optimizer as it is), or the kind torchao's AdamW keeps the moments in."""
    optimizer_lever: str
    """The lever of the set that replaces the optimizer ("" : none does)."""


class Undo:
    """What to do, last first, to take a model back to before an undoable apply."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []

    def add(self, step: Callable[[], None]) -> None:
        """Run ``step`` when undoing (after every step added later)."""
        self._steps.append(step)

    def run(self) -> None:
        """Undo everything, last first (each step once)."""
        while self._steps:
            self._steps.pop()()


@dataclass
class Applying:
    """A lever set being applied: what each lever's :meth:`Lever.apply` reads and writes."""

    model: nn.Module
    plan: Plan
    undo: Undo | None = None
    """Where to record how to undo (None: applied for good, e.g. by ``memfit.prepare``)."""
    optimizer_kind: str = "orig"
    """As :attr:`Predicting.optimizer_kind`."""
    optimizer_lever: str = ""
    """As :attr:`Predicting.optimizer_lever`."""
    bf16_weights: bool = False
    """The set keeps the floating weights in bf16."""


class Lever:
    """One lever: see the module's docstring for what it owns. Subclass it and set ``name``."""

    name: str = ""
    risk: int = 0
    """Numeric risk (0: exact); a set's risk is its levers' sum (See Note [lever sets in risk order])."""
    group: str = ""
    """Levers of one non-empty group are never in one set (the optimizer state's kinds)."""
    excludes: tuple[str, ...] = ()
    """Levers never in a set with this one (what it does already)."""
    order: int = 50
    """When it is applied and predicted among the set's levers (smaller first)."""
    planned: bool = True
    """The planner may choose it (False: applied only when a plan names it)."""
    step_facts: bool = False
    """Its facts need one forward of the step measured (the loss head, saved bytes)."""
    optimizer_kind: str | None = None
    """The kind torchao's AdamW keeps its moments in with this lever (None: no new optimizer)."""
    bf16_weights: bool = False
    """The set's floating weights are bf16 with this lever."""
    needs_optimizer: bool = False
    """Applying it needs the optimizer (``memfit.apply`` without one refuses it)."""

    def refusal(self, site: Site) -> str | None:
        """Why it cannot run at ``site`` (one sentence), or None."""
        return None

    def unpredictable(self, facts: LeverFacts | None) -> str | None:
        """Why a profile with ``facts`` cannot predict it (one sentence), or None."""
        return None

    def runs_at(self, precision: str) -> bool:
        """Whether a plan at ``precision`` may use it."""
        return True

    def settings(self, profiles: Mapping[str, Profile]) -> list[LeverSettings]:
        """The settings the planner tries, in order (the first whose plan fits is kept)."""
        return [{}]

    def at_settings(self, profile: Profile, settings: LeverSettings) -> Profile:
        """``profile`` with its facts at ``settings`` (pure; the same profile when nothing moves)."""
        return profile

    def check_settings(self, settings: LeverSettings) -> None:
        """Refuse settings a plan cannot hold (ConfigError, one sentence)."""

    def predict(self, out: Profile, ctx: Predicting) -> None:
        """Change ``out`` (a copy of ``ctx.base`` with the set's earlier levers) as the lever does."""

    def note(self, plan: Plan, profile: Profile, with_levers: Predict) -> str | None:
        """What the plan's report says about it (None: nothing); ``with_levers`` predicts a
        profile under a lever set (:func:`memfit.applying.registry.with_levers`)."""
        return None

    def clear(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Take off what an earlier apply installed that a new plan may not want (hooks, layers)."""

    def apply(self, optimizer: torch.optim.Optimizer | None, ctx: Applying) -> torch.optim.Optimizer | None:
        """Apply it to ``ctx.model`` and ``optimizer`` (recording the undo in ``ctx.undo`` when
        given); returns the optimizer to train with."""
        return optimizer
