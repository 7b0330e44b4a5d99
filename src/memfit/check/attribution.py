"""Overflow attribution: which module produced the first inf or NaN, in which phase.

PyTorch's GradScaler only knows that *some* gradient overflowed. :class:`OverflowWatch`
puts a forward hook on every module while it is open (and removes it when it closes, so
normal training pays nothing). The hook records the largest absolute value of the
module's output and registers a backward hook on that output tensor, which records the
largest absolute value of the gradient flowing into it. After a step it names the first
module, in execution order, whose output was not finite (forward), or, in backward order,
the module whose backward turned a finite output gradient into a non-finite gradient of
its inputs. Hooks fire innermost first, so the first non-finite record is the module that
produced the value, not a container that merely passed it on.

Trade-off: while open, each hooked module costs one ``abs().amax()`` per output, and the
step pays one device sync at the end; that is why the watch is for checking and for
replaying a failed step, not for every step of a long run.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> with torch.no_grad():
    ...     _ = model[1].weight.fill_(float("inf"))
    >>> def loss_fn(m, batch):
    ...     return m(batch).sum()
    >>> found = attribute(model, torch.ones(3, 2), loss_fn, Precision("fp32", device="cpu"))
    >>> found.module, found.phase, found.dtype
    ('1', 'forward', 'float32')
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memfit.measuring.preserve import preserved
from memfit.precision import Precision
from memfit.records import ModuleRange, NonFinite
from memfit.step import Batch, LossFn

__all__ = ["FP16_MAX", "OverflowWatch", "attribute", "grad_underflow_fractions"]

#: The largest finite fp16 value.
FP16_MAX = 65504.0
_LOSS = "<loss>"


def _floats(value: Any) -> Iterator[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0:
            yield t


def _amax(tensors: Iterable[torch.Tensor]) -> tuple[torch.Tensor, torch.dtype] | None:
    items = list(tensors)
    if not items:
        return None
    maxes = [t.detach().abs().amax().float() for t in items]
    return (maxes[0] if len(maxes) == 1 else torch.stack(maxes).amax()), items[0].dtype


def _in_backward() -> bool:
    # Forward hooks also fire when checkpointing recomputes a block during backward; those
    # calls repeat values already recorded, so they are not forward records.
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _display(name: str) -> str:
    return name or "(model)"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class OverflowWatch:
    """Hooks on every module of ``model`` while open; one analysis per step.

    Call :meth:`end_step` after each step to get the first non-finite value of that step
    (or None) and to fold the step's maxima into :attr:`ranges`.

    Args:
        model: the model to watch (hooks go on every submodule and the model itself).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._handles: list[Any] = []
        self._forward: list[tuple[str, torch.dtype, torch.Tensor]] = []
        self._backward: list[tuple[str, torch.dtype, torch.Tensor]] = []
        self.ranges: dict[str, tuple[str, float]] = {}
        """``{module: (output dtype, largest |output| so far)}``; inf once non-finite."""

    def __enter__(self) -> OverflowWatch:
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _forward_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _in_backward():
                return
            tensors = list(_floats(output))
            found = _amax(tensors)
            if found is None:
                return
            self._forward.append((name, found[1], found[0]))
            # The backward hooks are tensor hooks on module outputs, not
            # ``register_full_backward_hook``: full backward hooks wrap outputs in a custom
            # autograd Function, and a model that then modifies an output in place
            # (``out += identity``, ``ReLU(inplace=True)``, as ResNets do) fails with a
            # view+inplace error.
            if torch.is_grad_enabled():
                for t in tensors:
                    if t.requires_grad:
                        t.register_hook(self._grad_hook(name))

        return hook

    def _grad_hook(self, name: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._backward.append((name, grad.dtype, grad.detach().abs().amax().float()))

        return hook

    def begin_step(self) -> None:
        """Forget the records of an unfinished step."""
        self._forward.clear()
        self._backward.clear()

    def end_step(self, loss: float, step: int = 0, loss_dtype: str = "float32") -> NonFinite | None:
        """Analyse the step just run: the first non-finite value, in execution order.

        Args:
            loss: the step's loss (a float, possibly inf or NaN).
            step: the step number, copied into the record.
            loss_dtype: the dtype of the loss tensor.

        Returns:
            None when every output, the loss and every gradient were finite.
        """
        forward, backward = list(self._forward), list(self._backward)
        self.begin_step()
        values = torch.stack([v for _, _, v in forward + backward]).tolist() if forward or backward else []
        fwd_values, bwd_values = values[: len(forward)], values[len(forward) :]
        for (name, dtype, _), value in zip(forward, fwd_values, strict=True):
            old = self.ranges.get(name, (_dtype_name(dtype), 0.0))[1]
            self.ranges[name] = (_dtype_name(dtype), max(old, value) if math.isfinite(value) else math.inf)
        for (name, dtype, _), value in zip(forward, fwd_values, strict=True):
            if not math.isfinite(value):
                return _record(name, "forward", dtype, value, step)
        if not math.isfinite(loss):
            return NonFinite(_LOSS, "loss", loss_dtype, "nan" if math.isnan(loss) else "inf", step)
        for i, ((_name, dtype, _), value) in enumerate(zip(backward, bwd_values, strict=True)):
            if not math.isfinite(value):
                # The gradient into this output broke: the module whose backward ran
                # just before (the last finite record) made it; none before it: the loss.
                return _record(backward[i - 1][0] if i else _LOSS, "backward", dtype, value, step)
        return self._parameter_grads(step)

    def _parameter_grads(self, step: int) -> NonFinite | None:
        """A non-finite parameter gradient no module's input gradient showed (e.g. a first layer)."""
        owners = [(n, m) for n, m in self.model.named_modules()]
        for name, module in reversed(owners):
            grads = [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
            found = _amax(grads)
            if found is not None and not math.isfinite(value := float(found[0])):
                return _record(name, "backward", found[1], value, step)
        return None

    def module_ranges(self, underflow: dict[str, float] | None = None) -> list[ModuleRange]:
        """Per-module ranges, the closest to fp16's maximum first."""
        out = []
        for name, (dtype, max_abs) in self.ranges.items():
            finite = math.isfinite(max_abs)
            out.append(
                ModuleRange(
                    module=_display(name),
                    dtype=dtype,
                    max_abs=max_abs if finite else None,
                    fp16_fraction=max_abs / FP16_MAX if finite else None,
                    grad_underflow_fraction=(underflow or {}).get(name),
                )
            )
        return sorted(out, key=lambda r: -(r.fp16_fraction if r.fp16_fraction is not None else math.inf))


def _record(name: str, phase: str, dtype: torch.dtype, value: float, step: int) -> NonFinite:
    return NonFinite(_display(name), phase, _dtype_name(dtype), "nan" if math.isnan(value) else "inf", step)


def attribute(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    precision: Precision,
    step: int = 0,
    rng_state: torch.Tensor | None = None,
    cuda_rng_state: torch.Tensor | None = None,
) -> NonFinite | None:
    """Replay forward and backward of one batch with hooks and name the first non-finite value.

    The model, its gradients and the RNG are put back afterwards (no optimizer step is
    taken). The backward uses the precision's current loss scale, as training would.

    Args:
        model: the model, in the state it had before the step that failed.
        batch: the batch (or micro-batch) of that step.
        loss_fn: ``loss_fn(model, batch) -> loss``.
        precision: the precision the step ran in.
        step: the step number to put in the record.
        rng_state: the CPU RNG state the step started with (replays dropout exactly).
        cuda_rng_state: the current CUDA device's RNG state the step started with.

    Returns:
        The first non-finite value, or None if the replay was finite throughout.
    """
    scale = float(precision.scaler.get_scale()) if precision.scaler.is_enabled() else 1.0
    with preserved(model), OverflowWatch(model) as watch:
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        if cuda_rng_state is not None:
            torch.cuda.set_rng_state(cuda_rng_state)
        model.zero_grad(set_to_none=True)
        with precision.autocast():
            loss = loss_fn(model, batch)
        value = float(loss.detach())
        if math.isfinite(value) and loss.requires_grad:
            (loss * scale).backward()
        return watch.end_step(value, step, _dtype_name(loss.dtype))


def grad_underflow_fractions(
    model: nn.Module, batch: Batch, loss_fn: LossFn, scale: float, modules: Iterable[str]
) -> dict[str, float]:
    """Per module, the fraction of its non-zero output-gradient values fp16 flushes to zero.

    Runs one fp32 forward and backward (so the gradients are the true ones, not already
    flushed), multiplies each module's output gradient by the loss ``scale`` and counts the
    values that become 0 when cast to fp16. Model, gradients and RNG are put back.

    Args:
        model: the model.
        batch: one batch.
        loss_fn: ``loss_fn(model, batch) -> loss``.
        scale: the loss scale (the GradScaler's current scale).
        modules: qualified names of the modules to measure (those with fp16 outputs).

    Returns:
        ``{module: fraction}`` for the named modules whose outputs received a gradient.
    """
    wanted = set(modules)
    counts: dict[str, list[int]] = {}
    handles = []

    def count(name: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            g32 = grad.detach().float()
            nonzero = g32 != 0
            flushed = nonzero & ((g32 * scale).half() == 0)
            c = counts.setdefault(name, [0, 0])
            c[0] += int(flushed.sum())
            c[1] += int(nonzero.sum())

        return hook

    def make(name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _in_backward():
                return
            for t in _floats(output):
                if t.requires_grad:
                    t.register_hook(count(name))

        return hook

    with preserved(model):
        for name, module in model.named_modules():
            if name in wanted:
                handles.append(module.register_forward_hook(make(name)))
        try:
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            if math.isfinite(float(loss.detach())):
                loss.backward()
        finally:
            for h in handles:
                h.remove()
    return {name: flushed / total for name, (flushed, total) in counts.items() if total > 0}
