"""``memfit.apply``: put a plan's per-block checkpointing on a model, after checking it fits.

The plan is data (:class:`memfit.Plan`); this is the one call that acts on a model. A plan
made for another model is refused before anything changes: block names the model lacks,
blocks the model has that the plan leaves out, unknown modes, precisions or micro-batches.

Example:
    >>> from torch import nn
    >>> from memfit.checkpointing import checkpointed_blocks
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    >>> checkpointed_blocks(apply(model, Plan(blocks={"0": "full", "1": "keep"})))
    {'0': 'full'}
"""

from __future__ import annotations

import difflib

from torch import nn

from memfit.checkpointing import find_blocks, set_block_modes, uncheckpoint
from memfit.errors import ConfigError, MemfitError
from memfit.records import Plan

__all__ = ["apply", "validate_plan"]

_PRECISIONS = ("fp32", "bf16", "fp16")
_PLAN_MODES = {"keep": "none", "none": "none", "selective": "selective", "full": "full"}


def validate_plan(model: nn.Module, plan: Plan) -> None:
    """Refuse a plan that was not made for ``model``: block names it lacks, blocks it has that
    a planned plan leaves out, unknown modes, precision or micro-batches.

    Raises:
        ConfigError: one sentence naming the blocks or the value, and the fix.

    Example:
        >>> from torch import nn
        >>> validate_plan(nn.Sequential(nn.Linear(4, 4)), Plan(blocks={"0": "x"}))
        Traceback (most recent call last):
        ...
        memfit.errors.ConfigError: unknown block mode(s) {'0': 'x'} in the plan; use keep, selective or full.
    """
    modules = {n for n, _ in model.named_modules() if n}
    missing = [n for n in plan.blocks if n not in modules]
    if missing:
        hints = []
        for name in missing:
            close = difflib.get_close_matches(name, sorted(modules), n=1)
            hints.append(repr(name) + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(
            f"the plan names block(s) {', '.join(hints)} that {type(model).__name__} does not have; "
            "it was made for a different model: run memfit plan again for this one."
        )
    bad = {n: m for n, m in plan.blocks.items() if m not in _PLAN_MODES}
    if bad:
        raise ConfigError(f"unknown block mode(s) {bad} in the plan; use keep, selective or full.")
    if plan.precision not in _PRECISIONS:
        raise ConfigError(f"the plan's precision {plan.precision!r} is not one of {', '.join(_PRECISIONS)}.")
    if plan.micro_batches < 1:
        raise ConfigError(f"the plan's micro_batches must be at least 1, got {plan.micro_batches}.")
    if plan.blocks and plan.predicted_peak_bytes > 0:
        # NOTE: a plan the planner made (it has a prediction) covers every block it found; one
        # that covers only some of this model's blocks was made for a smaller model and would
        # leave the rest silently unplanned. A hand-written Plan may name only some blocks.
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
    """Apply a plan's per-block checkpointing to ``model`` in place and return it.

    Precision and micro-batches are run by the training step (``memfit.Trainer`` takes them
    from the plan); checkpointing not named by the plan is removed.

    Args:
        model: the model the plan was made for.
        plan: a :class:`Plan` (e.g. from :func:`plan` or ``Plan.from_json``).

    Returns:
        The same model object.

    Raises:
        ConfigError: the plan was not made for this model (see :func:`validate_plan`).

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> _ = apply(model, Plan(blocks={"0": "full", "1": "keep"}))
        >>> from memfit.checkpointing import checkpointed_blocks
        >>> checkpointed_blocks(model)
        {'0': 'full'}
    """
    validate_plan(model, plan)
    uncheckpoint(model)
    set_block_modes(model, {n: _PLAN_MODES[m] for n, m in plan.blocks.items()})
    return model
