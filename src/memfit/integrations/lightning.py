"""Lightning: a callback that applies a memfit plan, and the ``Trainer`` arguments it needs.

``lightning.Trainer(callbacks=[MemfitCallback(plan)], **trainer_kwargs(plan), ...)``:
:func:`trainer_kwargs` maps the plan's precision and micro-batches to Lightning's
``precision`` (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``) and
``accumulate_grad_batches``; :class:`MemfitCallback` applies the plan's per-block
checkpointing when training starts (in ``setup``, or after ``configure_model`` for a
module that builds its layers there) and stops with one sentence naming the Trainer
arguments to set when the Trainer's differ from the plan's. The DataLoader's batch size is
the plan's batch divided by its micro-batches (``plan.batch_size // plan.micro_batches``).

The plan may be made on the LightningModule or on the model inside it (e.g.
``memfit.plan(module.model, ...)``): the callback finds the submodule whose blocks the plan
names.

Trade-off: Lightning owns precision and accumulation (they are Trainer arguments fixed
before any callback runs), so the callback checks them rather than changing them behind
the Trainer's back.

Example (with ``lightning`` installed; the tests run it in ``.venv-extras``)::

    trainer = lightning.Trainer(max_steps=100, callbacks=[MemfitCallback(plan)], **trainer_kwargs(plan))
    trainer.fit(module, DataLoader(data, batch_size=plan.batch_size // plan.micro_batches))

Without it:
    >>> from memfit.records import Plan
    >>> trainer_kwargs(Plan(blocks={}, precision="bf16", micro_batches=2))
    {'precision': 'bf16-mixed', 'accumulate_grad_batches': 2}
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from memfit.applying import apply, batch_shapes
from memfit.errors import ConfigError
from memfit.precision import precision_kind
from memfit.records import Plan
from memfit.step import batch_size

try:  # the class must derive from Lightning's Callback; without lightning it is unusable.
    from lightning.pytorch import Callback as _Callback
except ImportError:  # pragma: no cover - depends on the environment
    try:
        from pytorch_lightning import Callback as _Callback
    except ImportError:
        _Callback = object

__all__ = ["MemfitCallback", "plan_target", "trainer_kwargs"]


def trainer_kwargs(plan: Plan) -> dict[str, Any]:
    """The ``lightning.Trainer`` arguments that run ``plan``: ``precision``, ``accumulate_grad_batches``."""
    return {
        "precision": precision_kind(plan.precision).lightning,
        "accumulate_grad_batches": plan.micro_batches,
    }


def plan_target(module: nn.Module, plan: Plan) -> nn.Module:
    """The submodule of ``module`` (or ``module`` itself) whose blocks the plan names.

    Raises:
        ConfigError: no submodule has every block the plan names.
    """
    names = {n for n, _ in module.named_modules()}
    for prefix, sub in sorted(module.named_modules(), key=lambda item: len(item[0])):
        lead = f"{prefix}." if prefix else ""
        if all(f"{lead}{block}" in names for block in plan.blocks):
            return sub
    missing = sorted(plan.blocks)[:3]
    raise ConfigError(
        f"{type(module).__name__} has no submodule with the plan's blocks ({', '.join(missing)}, ...); "
        "make the plan for this model (memfit.plan on the module or the model inside it)."
    )


class MemfitCallback(_Callback):
    """Apply ``plan`` to the LightningModule when training starts and check the Trainer runs it.

    Args:
        plan: a :class:`memfit.Plan` (from :func:`memfit.plan` or ``Plan.from_json``).

    Raises (at start-up):
        ConfigError: the Trainer's ``precision`` or ``accumulate_grad_batches`` differ from
            the plan's (the sentence names the values to set), the DataLoader's batch is not
            the plan's micro-batch, or the plan names blocks the module does not have.
    """

    def __init__(self, plan: Plan) -> None:
        if _Callback is object:
            raise ConfigError("MemfitCallback needs Lightning: pip install lightning.")
        super().__init__()
        self.plan = plan
        self.applied: nn.Module | None = None
        """The module the plan was applied to, once training started."""
        self._batch_checked = False

    def _apply(self, pl_module: nn.Module) -> None:
        if self.applied is None:
            # the plan's model and device are checked; Lightning moves the module to its device later
            self.applied = apply(plan_target(pl_module, self.plan), self.plan, on_device=False).model

    def _check_trainer(self, trainer: Any) -> None:
        want = trainer_kwargs(self.plan)
        have = {
            "precision": str(trainer.precision),
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
        }
        if have != want:
            args = ", ".join(f"{k}={v!r}" for k, v in want.items())
            now = ", ".join(f"{k}={v!r}" for k, v in have.items())
            raise ConfigError(
                f"the memfit plan runs with lightning.Trainer({args}) "
                f"(memfit.integrations.lightning.trainer_kwargs(plan)); this Trainer has {now}."
            )

    def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        """Check the Trainer's arguments; apply the plan if the module's blocks exist already."""
        if stage != "fit":
            return
        self._check_trainer(trainer)
        # Layers built by configure_model (after setup) get the plan in on_fit_start.
        with contextlib.suppress(ConfigError):
            self._apply(pl_module)

    def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
        """Apply the plan to a module whose layers ``configure_model`` built after ``setup``."""
        self._apply(pl_module)

    def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int) -> None:
        """Check once that the DataLoader gives the plan's micro-batch."""
        if self._batch_checked or not self.plan.batch_size:
            return
        self._batch_checked = True
        want = self.plan.batch_size // self.plan.micro_batches
        try:
            got = batch_size(tuple(batch) if isinstance(batch, list) else batch)
        except TypeError:
            return  # a batch memfit cannot size (a dict): Lightning's own checks apply
        if got != want:
            raise ConfigError(
                f"the DataLoader gives batches of {got}, but the plan's batch of {self.plan.batch_size} in "
                f"{self.plan.micro_batches} micro-batch(es) needs DataLoader(batch_size={want})."
            )
        was = self.plan.made_for
        shapes = batch_shapes(tuple(batch) if isinstance(batch, list) else batch)
        if was is not None and was.batch and shapes != [[want, *s[1:]] for s in was.batch]:
            raise ConfigError(
                f"the DataLoader gives batches of shape {shapes}, but the plan was made for {was.batch} in "
                f"{self.plan.micro_batches} micro-batch(es); plan again for this data."
            )
