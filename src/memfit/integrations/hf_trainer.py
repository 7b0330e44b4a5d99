"""The Hugging Face ``Trainer`` with a memory budget: one call that turns a plan into ``TrainingArguments``.

:func:`prepare_trainer` (``memfit.integrations.hf.prepare``) takes the model, the
``TrainingArguments`` the user would pass, the training dataset and a budget. It collates
one real batch of the effective size (``per_device_train_batch_size x
gradient_accumulation_steps``) with the collator the Trainer will use, turns the model's
cache off (a cache is of no use in training), plans with :func:`memfit.plan`, applies the
plan's per-block checkpointing to the model and returns new ``TrainingArguments`` with the
plan's precision (``bf16`` / ``fp16``) and its micro-batches as ``per_device_train_batch_size``
and ``gradient_accumulation_steps``, the effective batch unchanged. It logs one line saying
what it chose (logger ``memfit.integrations.hf``).

Trade-off: planning costs a profile of the model on that batch (a few training steps)
before the Trainer starts; in return the step's peak is planned and measured to fit the
budget instead of found by running out of memory, as ``auto_find_batch_size`` does.

Example (with ``transformers`` installed; the tests run it in ``.venv-extras``)::

    args = memfit.integrations.hf.prepare(model, args, train_dataset, budget="60%")
    transformers.Trainer(model=model, args=args, train_dataset=train_dataset).train()
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from memfit.applying import apply, check_made_for
from memfit.budget import Budget, format_bytes
from memfit.checkpointing import refuse_double_checkpointing
from memfit.errors import ConfigError
from memfit.planning.planner import plan
from memfit.precision import PRECISION_KINDS, precision_kind
from memfit.records import Plan
from memfit.report.table import mode_counts
from memfit.vocab import PrecisionChoice, normalize_precision

__all__ = ["dict_loss", "one_batch", "plan_for_trainer", "prepare_trainer"]

log = logging.getLogger("memfit.integrations.hf")

#: Arguments that fight the plan, and why each one has to go (the checkpointing one: _checkpointing_conflict).
_CONFLICTS = {
    "auto_find_batch_size": "memfit sets per_device_train_batch_size from the plan (and "
    "memfit.plan(..., maximize='batch_size') finds the largest batch that fits)",
}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "memfit.integrations.hf.prepare needs the transformers package: pip install 'memfit[hf]'."
        ) from None
    return transformers


def _checkpointing_conflict(args: Any) -> str:
    """The sentence refusing Hugging Face's own checkpointing in ``args``, in the spelling of its
    ``transformers`` (``activation_checkpointing`` from 5.24, ``gradient_checkpointing`` before); ""."""
    new = hasattr(args, "activation_checkpointing")
    name = "activation_checkpointing" if new else "gradient_checkpointing"
    if not getattr(args, name, False):
        return ""
    given = dict(getattr(args, f"{name}_kwargs", None) or {})
    offload = given.get("offload") is True
    also = f" and {name}_kwargs={given!r}" if offload else ""
    counted = ", and its plan does not count Hugging Face's offload to host memory" if offload else ""
    return (
        f"drop {name}=True{also} from TrainingArguments: memfit checkpoints the model's blocks as the plan "
        f"says, and both would recompute every block{counted}."
    )


def _check_args(args: Any) -> None:
    conflict = _checkpointing_conflict(args)
    if conflict:
        raise ConfigError(conflict)
    for name, why in _CONFLICTS.items():
        if getattr(args, name, False):
            raise ConfigError(f"drop {name}=True from TrainingArguments: {why}.")
    if args.bf16 and args.fp16:
        raise ConfigError(
            "TrainingArguments sets both bf16=True and fp16=True; keep one, or neither for auto."
        )


def one_batch(
    train_dataset: Any, size: int, data_collator: Callable[[list[Any]], Any] | None
) -> dict[str, Any]:
    """The first ``size`` examples of ``train_dataset``, collated as the Trainer will collate them."""
    if not hasattr(train_dataset, "__len__") or not hasattr(train_dataset, "__getitem__"):
        raise ConfigError(
            "memfit.integrations.hf.prepare profiles one real batch: give a train_dataset with len() and "
            "indexing (a datasets.Dataset, a list or a torch Dataset)."
        )
    if len(train_dataset) < size:
        raise ConfigError(
            f"train_dataset has {len(train_dataset)} examples, fewer than one batch of {size} "
            "(per_device_train_batch_size x gradient_accumulation_steps); give more data or a smaller batch."
        )
    collate = data_collator or _transformers().default_data_collator
    batch = collate([train_dataset[i] for i in range(size)])
    return dict(batch)


def dict_loss(keys: Sequence[str]) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]:
    """A memfit ``loss_fn`` for a Hugging Face model: ``model(**dict(zip(keys, batch))).loss``."""
    names = list(keys)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        out = model(**dict(zip(names, batch, strict=True)))
        loss = out["loss"] if isinstance(out, dict) else out[0]
        if loss is None:
            raise ConfigError("the model returned no loss: the collated batch needs labels (e.g. 'labels').")
        return loss

    return loss_fn


def _as_tuple(batch: dict[str, Any], device: torch.device) -> tuple[list[str], tuple[torch.Tensor, ...]]:
    bad = [k for k, v in batch.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ConfigError(
            f"the collated batch holds non-tensor field(s) {bad}; give a data_collator that returns tensors."
        )
    keys = list(batch)
    return keys, tuple(batch[k].to(device) for k in keys)


def _optimizer(transformers: Any, args: Any, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer the Trainer will build (its state is part of the step's memory)."""
    try:
        cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
        optimizer: torch.optim.Optimizer = cls(model.parameters(), **kwargs)
        return optimizer
    except (ImportError, ValueError, TypeError, RuntimeError) as exc:
        log.info(
            "memfit: profiling with torch.optim.AdamW (the Trainer's optimizer could not be built: %s)", exc
        )
        return torch.optim.AdamW(model.parameters(), lr=args.learning_rate)


def _visible() -> None:
    """Show this logger's lines on stderr when the program has not configured logging."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _cache_off(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
        log.info(
            "memfit: turned use_cache off (model.config.use_cache = False): training reuses no cache, "
            "and checkpointed blocks must not return one"
        )


def plan_for_trainer(
    model: nn.Module,
    args: Any,
    train_dataset: Any,
    budget: int | str | Budget | None,
    data_collator: Callable[[list[Any]], Any] | None = None,
    precision: PrecisionChoice = "auto",
    *,
    given: Plan | None = None,
) -> tuple[Plan, Any]:
    """:func:`prepare_trainer`, returning the :class:`memfit.Plan` as well as the new arguments.

    Returns:
        ``(plan, training_arguments)``.
    """
    transformers = _transformers()
    _visible()
    _check_args(args)
    refuse_double_checkpointing(model)
    _cache_off(model)
    model.to(args.device)
    effective = args.per_device_train_batch_size * args.gradient_accumulation_steps
    keys, batch = _as_tuple(one_batch(train_dataset, effective, data_collator), args.device)
    if given is not None:  # a decision made once is used as it is: nothing is profiled
        check_made_for(given, model=model, batch=batch, device=args.device)
        chosen = given
    else:
        chosen = _planned(transformers, model, args, batch, keys, budget, precision)
    apply(model, chosen)
    kind = precision_kind(chosen.precision)
    # TrainingArguments turns each mixed precision on with a flag of its own (bf16=, fp16=)
    flags = {k.transformers_flag: k is kind for k in PRECISION_KINDS.values() if k.transformers_flag}
    new = dataclasses.replace(
        args,
        per_device_train_batch_size=effective // chosen.micro_batches,
        gradient_accumulation_steps=chosen.micro_batches,
        **flags,
        # transformers runs bf16 on a CPU (one with AVX512-BF16 or AMX) only with use_cpu set
        use_cpu=args.use_cpu or (kind.dtype == torch.bfloat16 and args.device.type == "cpu"),
    )
    counts = ", ".join(f"{n} {m}" for m, n in sorted(mode_counts(chosen.blocks.values()).items()))
    log.info(
        "memfit: planned %s to %s (fp32 no-checkpointing peak %s): %s; %s; per_device_train_batch_size %d x "
        "gradient_accumulation_steps %d = %d per device and step, as before; predicted peak %s, measured %s",
        type(model).__name__,
        format_bytes(chosen.budget_bytes),
        format_bytes(chosen.report.baseline_peak_bytes),
        counts or "no blocks",
        chosen.precision,
        new.per_device_train_batch_size,
        new.gradient_accumulation_steps,
        effective,
        format_bytes(chosen.predicted_peak_bytes),
        format_bytes(chosen.measured_peak_bytes) if chosen.measured_peak_bytes else "-",
    )
    return chosen, new


def _planned(
    transformers: Any,
    model: nn.Module,
    args: Any,
    batch: tuple[torch.Tensor, ...],
    keys: Sequence[str],
    budget: int | str | Budget | None,
    precision: PrecisionChoice,
) -> Plan:
    if budget is None:
        raise ConfigError("memfit.integrations.hf.prepare needs a budget (e.g. '60%') or a plan.")
    asked = [
        k.name for k in PRECISION_KINDS.values() if k.transformers_flag and getattr(args, k.transformers_flag)
    ]
    wanted = normalize_precision(asked[0]) if asked else normalize_precision(precision, allow_auto=True)
    was_training = model.training
    model.train()
    try:
        return plan(model, batch, dict_loss(keys), budget, _optimizer(transformers, args, model), wanted)
    finally:
        model.train(was_training)


def prepare_trainer(
    model: nn.Module,
    args: Any,
    train_dataset: Any,
    budget: int | str | Budget | None = None,
    data_collator: Callable[[list[Any]], Any] | None = None,
    precision: PrecisionChoice = "auto",
    *,
    plan: Plan | None = None,
) -> Any:
    """Plan ``model`` for the Hugging Face ``Trainer`` to ``budget`` (or take ``plan`` as it is);
    return the ``TrainingArguments`` to use.

    Args:
        model: the ``transformers`` model the Trainer will train (checkpointed in place).
        args: the ``TrainingArguments`` you would pass; ``per_device_train_batch_size x
            gradient_accumulation_steps`` is the batch per device and step, kept as it is.
        train_dataset: the training dataset (its first batch is profiled).
        budget: the peak of one training step: bytes, ``"6GiB"`` or ``"60%"`` of the fp32
            no-checkpointing peak.
        data_collator: the collator you will give the Trainer (default:
            ``transformers.default_data_collator``).
        precision: ``"auto"``, ``"fp32"``, ``"bf16"`` or ``"fp16"`` when ``args`` sets neither
            ``bf16`` nor ``fp16`` (a precision set in ``args`` is kept).
        plan: a plan made before (``memfit.plan`` or ``memfit plan``'s plan.json) to use as it is,
            instead of planning: nothing is profiled, and one made for another model, batch or
            device is refused.

    Returns:
        New ``TrainingArguments``: ``bf16`` / ``fp16`` from the plan, and
        ``per_device_train_batch_size`` / ``gradient_accumulation_steps`` from its micro-batches.

    Raises:
        ConfigError: an argument that fights the plan (``activation_checkpointing=True``, with
            its ``offload``; ``auto_find_batch_size=True``: one sentence names it as written),
            Hugging Face's own checkpointing on the model
            (``model.activation_checkpointing_enable(...)``, named back with its arguments), or a
            dataset / collator memfit cannot profile.
        InfeasibleBudget: nothing fits the budget.
    """
    return plan_for_trainer(model, args, train_dataset, budget, data_collator, precision, given=plan)[1]
