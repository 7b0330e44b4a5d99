"""What a lever set's bytes rest on, counted and measured: :func:`lever_facts`.

Parameter counts per part are read from the model (exact). The temporaries of one
parameter's optimizer step are measured once per optimizer kind on a parameter of its own
(:data:`PROBE_NUMEL` elements, MemTracker, the step run eagerly as under every memfit
tracker) and kept per element: a fused step (:mod:`memfit.levers.fused`) holds one
parameter's step temporaries inside the backward, and torchao steps one parameter at a time.

Trade-off: the per-element cost is measured on one size and scaled linearly; torchao's
block-wise (de)quantization allocates in proportion to the elements, so the error is the
few fixed-size buffers (at most a few KiB).

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(64, 64)
    >>> facts = lever_facts(lin, torch.optim.AdamW(lin.parameters()), [], kinds=["orig"])
    >>> facts.params, facts.optimizer, facts.step_temp_per_element["orig/fp32"] > 0
    ({'': [4096, 64]}, 'AdamW', True)
    >>> facts.step_seconds_per_element["orig/fp32"] > 0
    True
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from memfit.checkpointing.compile import eager
from memfit.levers.optim import lever_optimizer
from memfit.levers.spec import torchao_available
from memfit.levers.weights import weights_dtype
from memfit.measuring.tracker import MemoryWatch
from memfit.records import LeverFacts, Profile
from memfit.stepmodel.with_levers import temp_key
from memfit.vocab import WEIGHTS

__all__ = ["PROBE_NUMEL", "attach_lever_facts", "lever_facts", "step_temp_per_element"]

#: Elements of the parameter an optimizer kind's step temporaries are measured on.
PROBE_NUMEL = 65536
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _family(optimizer: torch.optim.Optimizer | None) -> str:
    if optimizer is None:
        return "none"
    return str(getattr(optimizer, "memfit_family", type(optimizer).__name__))


def _probe_optimizer(
    optimizer: torch.optim.Optimizer | None, param: nn.Parameter, kind: str, weights: str
) -> torch.optim.Optimizer:
    """An optimizer like ``optimizer`` (its defaults) over ``param`` alone, of state ``kind``."""
    defaults = dict(optimizer.defaults) if optimizer is not None else {}
    cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    if optimizer is not None and not hasattr(optimizer, "memfit_state"):
        cls = type(optimizer)
    if optimizer is not None and hasattr(optimizer, "memfit_state"):
        defaults = {k: v for k, v in defaults.items() if k != "bf16_stochastic_round"}
        defaults["lr"] = float(defaults["lr"])
    if kind == "orig":
        takes = inspect.signature(cls.__init__).parameters
        return cls([param], **{k: v for k, v in defaults.items() if k in takes})
    base = torch.optim.AdamW([param], **_adam(defaults))
    return lever_optimizer(base, kind, weights_bf16=weights == "bf16")


def _adam(defaults: dict[str, Any]) -> dict[str, Any]:
    keys = ("lr", "betas", "eps", "weight_decay", "amsgrad")
    return {k: defaults[k] for k in keys if k in defaults}


def step_temp_per_element(
    optimizer: torch.optim.Optimizer | None, kind: str, weights: str, numel: int = PROBE_NUMEL
) -> tuple[float, float]:
    """Bytes and seconds per element of a single parameter's optimizer step: the bytes it holds
    beyond the parameter, its gradient and its state, and the median time of 3 steps (both
    measured eagerly; ``kind`` ``orig`` is ``optimizer``'s own class)."""
    torch.manual_seed(0)
    holder = nn.Module()
    holder.p = nn.Parameter(torch.zeros(numel, dtype=_DTYPES[weights]))
    opt = _probe_optimizer(optimizer, holder.p, kind, weights)
    # See Note [compiled code runs eagerly when tracked]; here the compile would also cost
    # more than the measurement.
    with eager():
        holder.p.grad = torch.randn_like(holder.p) * 1e-3
        opt.step()  # creates the state
        holder.p.grad = torch.randn_like(holder.p) * 1e-3
        with MemoryWatch(holder, opt) as watch:
            opt.step()
        times = []
        for _ in range(3):
            started = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - started)
    held = sum(watch.breakdown.get(k, 0) for k in ("params", "grads"))
    state = 0
    for per in opt.state.values():
        for v in per.values():
            if isinstance(v, torch.Tensor):
                state += _nbytes(v)
    return max(0, watch.peak_bytes - held - state) / numel, statistics.median(times) / numel


def _nbytes(t: torch.Tensor) -> int:
    inner = getattr(t, "__tensor_flatten__", None)
    if inner is not None:
        names, _ = inner()
        return sum(_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def lever_facts(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    blocks: Sequence[str],
    kinds: Sequence[str] = ("orig", "fp32", "bf16", "8bit", "4bit"),
) -> LeverFacts:
    """Parameter counts per part of ``model`` and the step temporaries of each kind asked for.

    Kinds that need torchao are skipped when it is missing (their levers are refused anyway).
    """
    owner: dict[int, str] = {}
    for name in blocks:
        for p in model.get_submodule(name).parameters():
            owner.setdefault(id(p), name)
    params: dict[str, list[int]] = {}
    frozen = other = 0
    seen: set[int] = set()
    floats = [p for p in model.parameters() if p.is_floating_point()]
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if not p.is_floating_point():
            other += p.numel() * p.element_size()
        elif p.requires_grad:
            params.setdefault(owner.get(id(p), ""), []).append(p.numel())
        else:
            frozen += p.numel()
    other += sum(b.numel() * b.element_size() for b in model.buffers())
    weights = weights_dtype(model)
    temps: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for kind in kinds:
        if kind != "orig" and (not torchao_available() or _family(optimizer) not in ("Adam", "AdamW")):
            continue
        if kind == "orig" and optimizer is None:
            continue
        for w in WEIGHTS:
            if kind == "orig" and w != weights:
                continue
            temps[temp_key(kind, w)], seconds[temp_key(kind, w)] = step_temp_per_element(optimizer, kind, w)
    amsgrad = bool(optimizer is not None and optimizer.defaults.get("amsgrad", False))
    return LeverFacts(
        params=params,
        frozen_numel=frozen,
        other_bytes=other,
        weight_bytes=floats[0].element_size() if floats else 4,
        amsgrad=amsgrad,
        optimizer=_family(optimizer),
        step_temp_per_element=temps,
        step_seconds_per_element=seconds,
    )


def attach_lever_facts(
    profile: Profile, model: nn.Module, optimizer: torch.optim.Optimizer | None, blocks: Sequence[str]
) -> Profile:
    """Set ``profile.lever_facts`` and ``profile.weights`` from ``model`` (returns ``profile``)."""
    profile.lever_facts = lever_facts(model, optimizer, blocks)
    profile.weights = weights_dtype(model)
    return profile
