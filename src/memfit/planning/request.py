"""What a ``memfit.plan`` call asks for, resolved and refused once: :class:`Request`.

Everything a bad argument can be refused for is refused here, before anything runs: the
precisions (``"auto"``: fp32 and what the device runs natively), the levers (each named one
must run here; ``"all"`` keeps those that can), the blocks, and the budget (parsed once into
a :class:`~memfit.budget.Budget`; a budget of bytes larger than the device holds is refused
now, a percentage once its baseline is measured). The device's room is read now too,
before measuring's snapshot of the weights (See Note [room before the snapshot]). The
planner's steps (measure, choose, check) read this record and never derive it again.

Example:
    >>> import torch
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> x = torch.randint(0, 256, (4, 16))
    >>> r = resolve_request(model, (x, x), gpt_loss, "60%", None, "fp32")
    >>> r.precisions, r.budget.fraction, r.blocks
    (('fp32',), 0.6, ('blocks.0', 'blocks.1'))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from memfit.applying.registry import allowed_levers, site_of
from memfit.budget import Budget, format_bytes
from memfit.checkpointing import find_blocks
from memfit.checkpointing.blocks import resolve_blocks
from memfit.devices import Room, model_device, room
from memfit.errors import LeverRefused
from memfit.planning.budgets import held_bytes, refuse_over_room
from memfit.planning.choose import candidate_precisions
from memfit.step import Batch, LossFn, batch_size
from memfit.vocab import PrecisionChoice, PrecisionName

__all__ = ["Request", "resolve_request"]

# Note [room before the snapshot]
# The device's room is read before measuring's snapshot of the weights (on a CPU the snapshot
# takes room the training steps will have): what a step may hold is what is held now plus
# the room.


@dataclass(frozen=True)
class Request:
    """A ``memfit.plan`` call, resolved: what every step of the planner reads."""

    model: nn.Module
    batch: Batch
    loss_fn: LossFn
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    budget: Budget
    precisions: tuple[PrecisionName, ...]
    """The precisions to choose from, in order of preference."""
    levers: tuple[str, ...]
    """The levers a plan may use (those asked for that can run here)."""
    refused: Mapping[str, str]
    """``{lever: why not}`` for those of ``"all"`` that cannot run here."""
    blocks: tuple[str, ...]
    """The blocks to plan (the user's, else :func:`memfit.find_blocks`'s)."""
    room: Room | None
    """The device's room when planning began (None: unknown)."""
    held: int
    """Bytes of weights, buffers and optimizer state held when the room was read."""
    check: bool = True
    """Measure the chosen plan (and plan again under a tighter budget if it is over)."""
    verify: bool = False
    """Check the chosen levers on the model (:mod:`memfit.planning.verify`)."""
    split: bool = True
    """Micro-batches allowed (False: the largest-batch search's batch, planned whole)."""
    steps_within: int | None = None
    """A peak measuring's real steps keep under where they can (the longest-sequence search's
    budget; See Note [real steps within the budget] in memfit/planning/longest_sequence.py)."""

    def budget_bytes(self, baseline_peak: int) -> int:
        """The budget in bytes: a percentage of ``baseline_peak``, ``"device"`` what is held plus
        the room less its margin; a percentage over what the device holds is refused here (a
        byte budget was refused when the request was resolved)."""
        usable = self.held + self.room.usable if self.room is not None else None
        resolved = self.budget.resolve(baseline_peak, room=usable)
        if self.budget.is_fraction:
            refuse_over_room(resolved, self.budget, self.room, self.held, self.device)
        return resolved

    @property
    def shown(self) -> str:
        """The budget as progress shows it: ``60%``, ``2.00 GiB``, ``device``."""
        return format_bytes(self.budget.bytes) if self.budget.bytes is not None else str(self.budget)

    @property
    def phase(self) -> str:
        """What the plan's phase of progress says: ``planning a batch of 8 for 60% (fp32, bf16)``."""
        return f"planning a batch of {batch_size(self.batch)} for {self.shown} ({', '.join(self.precisions)})"


def resolve_request(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    budget: int | str | Budget,
    optimizer: torch.optim.Optimizer | None,
    precision: PrecisionChoice | Sequence[PrecisionName],
    *,
    levers: str | Sequence[str] | None = None,
    blocks: str | Sequence[str] | None = None,
    check: bool = True,
    verify: bool = False,
) -> Request:
    """Resolve a call's arguments into a :class:`Request`, refusing what cannot be planned.

    Raises:
        UnsupportedPrecision: an unknown precision.
        ConfigError: an unknown lever or block, or a budget that cannot be read.
        LeverRefused: a lever named explicitly cannot run here.
        ConfigError: a budget of bytes larger than the device holds.
    """
    device = model_device(model)
    wanted = candidate_precisions(precision, device)
    mode = precision if isinstance(precision, str) else ("auto" if "bf16" in precision else precision[0])
    allowed, refused = allowed_levers(levers, site_of(device, optimizer, mode, model))
    if not (isinstance(levers, str) and levers.strip() == "all"):
        for name, why in refused.items():
            raise LeverRefused(why, name)
    spec = Budget.parse(budget)  # a bad budget is refused before anything runs
    names = find_blocks(model) if blocks is None else resolve_blocks(model, blocks)
    # See Note [room before the snapshot]
    r, held = room(device), held_bytes(model, optimizer)
    if spec.bytes is not None:  # refused at once, before any progress is shown
        refuse_over_room(spec.bytes, spec, r, held, device)
    return Request(
        model, batch, loss_fn, optimizer, device, spec, tuple(wanted), tuple(allowed), dict(refused),
        tuple(names), r, held, check, verify,
    )  # fmt: skip
