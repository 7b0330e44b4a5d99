"""``memfit.apply``: the one call that changes a model the way a :class:`memfit.Plan` says.

A plan is plain data (``memfit.plan`` decides, ``Plan.from_json`` reads one back); applying
it checks that it fits this model first (block names that exist, known modes and
precision) and then sets each block's checkpointing. The precision and the micro-batches
are run by the training step, not stored in the model.

Trade-off: a plan made for another model is refused with the names it lacks rather than
applied to whatever matches, so a stale plan.json never silently leaves blocks unplanned.

Example:
    >>> from torch import nn
    >>> from memfit.checkpointing import checkpointed_blocks
    >>> from memfit.records import Plan
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    >>> _ = apply(model, Plan(blocks={"0": "full", "1": "none"}))
    >>> checkpointed_blocks(model)
    {'0': 'full'}
"""

from __future__ import annotations

import difflib

from torch import nn

from memfit.checkpointing import find_blocks, set_block_modes, uncheckpoint
from memfit.checkpointing.segments import set_segments
from memfit.errors import ConfigError, MemfitError
from memfit.records import Plan
from memfit.vocab import PRECISIONS, normalize_modes

__all__ = ["apply", "check_plan_fits"]


def check_plan_fits(model: nn.Module, plan: Plan) -> None:
    """Refuse a plan that does not fit ``model``: unknown blocks, modes, precision or micro-batches,
    or a planned plan that leaves out some of the model's blocks.

    Raises:
        ConfigError: one sentence naming what does not fit and what to do.
    """
    modules = {n for n, _ in model.named_modules() if n}
    named = list(plan.blocks) + [n for seg in plan.segments for n in seg if n not in plan.blocks]
    missing = [n for n in named if n not in modules]
    if missing:
        hints = []
        for name in missing:
            close = difflib.get_close_matches(name, sorted(modules), n=1)
            hints.append(repr(name) + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(
            f"the plan names block(s) {', '.join(hints)} that {type(model).__name__} does not have; "
            "it was made for a different model: run memfit plan again for this one."
        )
    normalize_modes(plan.blocks)
    if plan.precision not in PRECISIONS:
        raise ConfigError(f"the plan's precision {plan.precision!r} is not one of {', '.join(PRECISIONS)}.")
    if plan.micro_batches < 1:
        raise ConfigError(f"the plan's micro_batches must be at least 1, got {plan.micro_batches}.")
    if plan.blocks and plan.predicted_peak_bytes > 0:
        # Note [plans that name only some blocks]
        # A plan the planner made (it has a prediction) covers every block it found; one that
        # covers only some of this model's blocks was made for a smaller model and would leave
        # the rest silently unplanned. A hand-written Plan may name only some blocks.
        try:
            blocks = find_blocks(model)
        except MemfitError:
            blocks = []
        left_out = [b for b in blocks if b not in plan.blocks]
        if left_out and set(plan.blocks) <= set(blocks):
            raise ConfigError(
                f"the plan covers {len(plan.blocks)} of the {len(blocks)} blocks of {type(model).__name__} "
                f"(not {', '.join(repr(b) for b in left_out[:3])}); it was made for a different model: "
                "run memfit plan again for this one."
            )


def apply(model: nn.Module, plan: Plan) -> nn.Module:
    """Apply a plan's per-block checkpointing and segments to ``model`` in place and return it.

    Precision and micro-batches are run by the training step (``memfit.Trainer`` takes them
    from the plan); checkpointing not named by the plan is removed.

    Args:
        model: the model the plan was made for.
        plan: a :class:`memfit.Plan` (e.g. from :func:`memfit.plan` or ``Plan.from_json``).

    Returns:
        The same model object.

    Raises:
        ConfigError: the plan names blocks the model does not have, or an unknown mode.
    """
    check_plan_fits(model, plan)
    uncheckpoint(model)
    inside = {n for seg in plan.segments for n in seg}
    set_block_modes(model, {n: m for n, m in normalize_modes(plan.blocks).items() if n not in inside})
    set_segments(model, plan.segments)
    return model
