"""Hugging Face accelerate: the ``Accelerator`` arguments that run a memfit plan.

The recipe (tested in ``tests/integrations/test_lightning_accelerate.py``)::

    plan = memfit.plan(model, batch, loss_fn, "60%", optimizer)
    memfit.apply(model, plan)                                   # per-block checkpointing
    accelerator = Accelerator(**accelerator_kwargs(plan))      # mixed_precision, accumulation
    loader = DataLoader(data, batch_size=plan.batch_size // plan.micro_batches)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model, batch))
            optimizer.step()
            optimizer.zero_grad()

accelerate runs the autocast, the loss scaling (fp16) and the accumulation; memfit's part
is the checkpointing applied to the model and the two arguments below.

Example:
    >>> from memfit.records import Plan
    >>> accelerator_kwargs(Plan(blocks={}, precision="fp16", micro_batches=4))
    {'mixed_precision': 'fp16', 'gradient_accumulation_steps': 4}
"""

from __future__ import annotations

from typing import Any

from memfit.precision import precision_kind
from memfit.records import Plan

__all__ = ["accelerator_kwargs"]


def accelerator_kwargs(plan: Plan) -> dict[str, Any]:
    """The ``accelerate.Accelerator`` arguments for ``plan``: ``mixed_precision`` and
    ``gradient_accumulation_steps``."""
    return {
        "mixed_precision": precision_kind(plan.precision).accelerate,
        "gradient_accumulation_steps": plan.micro_batches,
    }
