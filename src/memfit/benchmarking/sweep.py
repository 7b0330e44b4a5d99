"""Measure memory against step time for many strategies, side by side, in one run.

For each strategy a fresh deep copy of the model (same weights) is prepared, gets a fresh
optimizer, runs one warm-up step (which also creates the optimizer state) under
``FlopCounterMode``, then one step under the same tracking as :func:`memfit.measure` for
its peak bytes. Then the timed steps run interleaved, A B C A B C ..., so that a noisy
machine's drift hits every strategy alike; each strategy's time is the median of its
steps. Trade-off: holding every copy at once costs host memory (on a GPU the copies not
running are parked on the CPU, so each peak is that strategy's alone), and the
interleaving makes a run as slow as all strategies together.

Example:
    >>> import torch
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> x = torch.randint(0, 256, (2, 16))
    >>> points = bench(model, (x, x), gpt_loss, torch.optim.AdamW(model.parameters()),
    ...                strategies=["fp32/none", "fp32/full"], steps=1)
    >>> [(p.strategy, p.peak_ratio < 1.0) for p in points]
    [('fp32/none', False), ('fp32/full', True)]
"""

from __future__ import annotations

import copy
import functools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from memfit.benchmarking.copies import (
    OptimizerArg,
    Parked,
    batch_to,
    check_optimizer,
    fresh_optimizer,
    park,
    unpark,
)
from memfit.benchmarking.pareto import mark_front
from memfit.benchmarking.strategies import Strategy, builtin_strategy, resolve_strategies
from memfit.budget import format_bytes
from memfit.checkpointing import uncheckpoint
from memfit.devices import device_facts, model_device, room, seconds_of
from memfit.errors import ConfigError, MemfitError, OutOfMemory
from memfit.measuring.memory import tracked_step
from memfit.measuring.phases import optimizer_state_bytes, phased_step
from memfit.measuring.preserve import create_optimizer_state
from memfit.measuring.twin import make_twin, twin_precision
from memfit.precision import Precision, precision_kind
from memfit.progress import configured, phase
from memfit.records import BenchPoint
from memfit.step import Batch, LossFn, training_step
from memfit.vocab import PrecisionName

__all__ = ["bench"]


@dataclass
class _Run:
    """One strategy's live state between the memory phase and the timed rounds."""

    strategy: Strategy
    point: BenchPoint
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    precision: Precision | None = None
    parked: list[Parked] = field(default_factory=list)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, MemfitError):
        return str(exc).rstrip(".")
    if isinstance(exc, torch.OutOfMemoryError):
        return "out of memory: " + str(exc).splitlines()[0][:200]
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:300]}"


def _flops(model: nn.Module, batch: Batch, loss_fn: LossFn, optimizer: Any, run: _Run) -> int:
    assert run.precision is not None
    with FlopCounterMode(display=False) as counter:
        training_step(model, batch, loss_fn, optimizer, run.precision, run.strategy.micro_batches)
    return int(counter.get_total_flops())


def _prepare(
    run: _Run,
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    template: OptimizerArg,
    device: torch.device,
    seed: int,
) -> None:
    """Memory phase of one strategy: copy, prepare, warm-up (FLOPs counted), tracked step, park."""
    s, point = run.strategy, run.point
    run.precision = Precision(s.precision, device=device)
    copied = copy.deepcopy(model).to(device)
    uncheckpoint(copied)
    copied.train()
    run.model = s.prepare(copied, batch, loss_fn)
    run.optimizer = fresh_optimizer(template, model, run.model)
    _refuse_what_cannot_fit(run, batch, loss_fn, device)
    torch.manual_seed(seed)
    point.flops = _flops(run.model, batch, loss_fn, run.optimizer, run)
    peak, breakdown, _ = tracked_step(
        run.model, batch, loss_fn, run.optimizer, run.precision, s.micro_batches
    )
    point.peak_bytes = int(peak)
    point.breakdown = {k: int(v) for k, v in breakdown.items()}
    run.parked = park(run.model, run.optimizer, device)


def _refuse_what_cannot_fit(run: _Run, batch: Batch, loss_fn: LossFn, device: torch.device) -> None:
    """Raise :class:`OutOfMemory` (the strategy is reported as not fitting, with its estimated
    peak) where its step, run on a fake-tensor twin, does not fit the device's room; a model
    that cannot run on fake tensors is run for real as before."""
    assert run.model is not None and run.precision is not None
    try:
        twin = make_twin(run.model, run.optimizer, batch)
        with twin.running():
            create_optimizer_state(twin.model, twin.optimizer)
            precision = twin_precision(run.precision)
            mem = phased_step(twin.model, twin.batch, loss_fn, twin.optimizer, precision, [])
    except Exception:  # See Note [fake tensors first, real tensors where they fail]
        return
    extra = mem.peak - mem.start + sum(optimizer_state_bytes(twin.optimizer).values())
    r = room(device)  # See Note [room after the fake step]
    if r is not None and not r.fits(extra):
        run.point.peak_bytes = int(mem.peak)
        raise OutOfMemory(
            f"does not fit: estimated under fake tensors at {format_bytes(mem.peak)}, "
            f"{format_bytes(extra)} more than {device} has room for now ({format_bytes(r.free)}, "
            f"{r.source}); not run"
        )


def _drop(run: _Run, exc: BaseException, device: torch.device) -> None:
    run.point.error = _reason(exc)
    run.model = run.optimizer = None
    run.parked.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _baseline_flops(
    precision: PrecisionName,
    points: dict[str, BenchPoint],
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    device: torch.device,
    cache: dict[str, int],
) -> int:
    """FLOPs of one step at ``precision`` without checkpointing (reusing ``precision/none``)."""
    if precision not in cache:
        same = points.get(f"{precision}/none")
        if same is not None and same.ok:
            cache[precision] = same.flops
        else:
            plain = _Run(
                strategy=builtin_strategy(precision, "none"), point=BenchPoint("", precision, "none")
            )
            plain.precision = Precision(precision, device=device)
            cache[precision] = _plain_flops(model, batch, loss_fn, plain, device)
    return cache[precision]


def _plain_flops(model: nn.Module, batch: Batch, loss_fn: LossFn, plain: _Run, device: torch.device) -> int:
    """The plain step's FLOPs, counted on a fake-tensor twin (nothing allocated: the plain step
    need not fit); a model fake tensors cannot run is counted on a real copy."""
    assert plain.precision is not None
    try:
        twin = make_twin(model, None, batch)
        fake = _Run(strategy=plain.strategy, point=plain.point, precision=twin_precision(plain.precision))
        with twin.running():
            return _flops(uncheckpoint(twin.model.to(device)).train(), twin.batch, loss_fn, None, fake)
    except Exception:  # See Note [fake tensors first, real tensors where they fail]
        copied = uncheckpoint(copy.deepcopy(model).to(device)).train()
        return _flops(copied, batch, loss_fn, None, plain)


def _finish(runs: Sequence[_Run], baseline: str) -> None:
    """Medians, ratios to the baseline (or the first strategy that ran), and the front."""
    points = [r.point for r in runs]
    for p in points:
        if p.ok:
            p.step_seconds = statistics.median(p.step_times)
    ok = [p for p in points if p.ok]
    base = next((p for p in ok if p.strategy == baseline), ok[0] if ok else None)
    for p in ok:
        assert base is not None
        p.baseline = base.strategy
        p.peak_ratio = p.peak_bytes / base.peak_bytes if base.peak_bytes else 0.0
        p.time_ratio = p.step_seconds / base.step_seconds if base.step_seconds else 0.0
    mark_front(points)


@dataclass(frozen=True)
class _Bench:
    """What every strategy's steps share: the model they copy, the batch, the device."""

    model: nn.Module
    batch: Batch
    loss_fn: LossFn
    optimizer: OptimizerArg
    device: torch.device
    seed: int


def _check_steps(steps: int, slow_steps: int | None) -> None:
    for label, value in (("steps", steps), ("slow_steps", steps if slow_steps is None else slow_steps)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{label} must be a positive integer, got {value!r}.")


def _runs(chosen: Sequence[Strategy], device: torch.device) -> list[_Run]:
    tracker = "cuda-allocator" if device.type == "cuda" else "MemTracker"
    return [
        _Run(
            s,
            BenchPoint(
                s.name,
                s.precision,
                s.checkpointing,
                micro_batches=s.micro_batches,
                device=str(device),
                tracker=tracker,
            ),
        )
        for s in chosen
    ]


def _wanted(runs: Sequence[_Run], device: torch.device, steps: int, slow_steps: int | None) -> dict[str, int]:
    """Timed steps per strategy: ``slow_steps`` for precisions the device only emulates."""
    facts = device_facts(device)
    return {
        r.point.strategy: steps
        if precision_kind(r.strategy.precision).native(facts) or slow_steps is None
        else slow_steps
        for r in runs
    }


def _memory_phase(b: _Bench, runs: Sequence[_Run]) -> None:
    """Each strategy's peak and FLOPs, one at a time; then its share of recompute."""
    with phase("bench: memory and FLOPs of each strategy", len(runs)) as shown:
        for run in runs:
            try:
                _prepare(run, b.model, b.batch, b.loss_fn, b.optimizer, b.device, b.seed)
            except Exception as exc:
                _drop(run, exc, b.device)
            shown.advance(detail=run.strategy.name)
    by_name = {r.point.strategy: r.point for r in runs}
    cache: dict[str, int] = {}
    for run in runs:
        if run.point.ok:
            try:
                base = _baseline_flops(
                    run.strategy.precision, by_name, b.model, b.batch, b.loss_fn, b.device, cache
                )
                run.point.recompute_fraction = run.point.flops / base if base else 0.0
            except Exception as exc:
                _drop(run, exc, b.device)


def _timed_step(b: _Bench, run: _Run) -> None:
    """One timed step of ``run``'s copy, brought back from where it was parked and parked again."""
    assert run.model is not None and run.precision is not None
    unpark(run.model, run.parked, b.device)
    step = functools.partial(
        training_step, run.model, b.batch, b.loss_fn, run.optimizer, run.precision, run.strategy.micro_batches
    )
    run.point.step_times.append(seconds_of(step, b.device))
    run.parked = park(run.model, run.optimizer, b.device)


def _timed_rounds(b: _Bench, runs: Sequence[_Run], wanted: dict[str, int]) -> None:
    """The timed steps, interleaved A B C A B C ... so that drift hits every strategy alike."""
    total = sum(wanted[r.point.strategy] for r in runs)
    with phase("bench: timed steps, strategies interleaved", total) as shown:
        for round_ in range(max(wanted.values())):
            for run in runs:
                if round_ >= wanted[run.point.strategy]:
                    continue
                if run.point.ok and run.model is not None and run.precision is not None:
                    try:
                        _timed_step(b, run)
                    except Exception as exc:
                        _drop(run, exc, b.device)
                shown.advance(detail=run.strategy.name)


def bench(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: OptimizerArg = None,
    strategies: Sequence[str | Strategy] | None = None,
    steps: int = 3,
    slow_steps: int | None = None,
    baseline: str = "fp32/none",
    device: str | torch.device | None = None,
    seed: int = 0,
    progress: bool | None = None,
) -> list[BenchPoint]:
    """Measure peak bytes, median step time and FLOPs of every strategy on fresh model copies.

    Args:
        model: the model; it is deep-copied per strategy and never changed.
        batch: a tensor or tuple of tensors whose first dimension is the batch.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        optimizer: an optimizer over ``model``'s parameters (each copy gets a new one of
            the same class and settings), or ``optimizer_fn(params)``; None benches
            forward and backward only.
        strategies: names (``"bf16/full"``), patterns (``"bf16/*"``) or :class:`Strategy`
            objects; default all built-in ones.
        steps: timed steps per strategy (interleaved); the median is reported.
        slow_steps: timed steps for strategies whose precision the device only emulates
            (bf16/fp16 on most CPUs, ~20x slower); default ``steps``.
        baseline: the strategy ratios are taken against; measured even when not listed.
        device: where the copies run (default: the model's device). For a GPU, keep the
            model on the CPU and pass ``device="cuda"``: a model left on the GPU is in
            every strategy's allocator peak.
        seed: RNG seed set before each strategy's warm-up, so dropout draws alike.
        progress: True: show progress (:mod:`memfit.progress`: a bar on a terminal, lines in
            a log); False: none; None (default): as :mod:`memfit.progress` decides.

    Returns:
        One :class:`BenchPoint` per strategy in the order given (baseline first if it was
        added); failed strategies carry ``error`` instead of numbers.

    Raises:
        ConfigError: an unknown strategy name, ``steps < 1``, or an optimizer that is not
            over the model's parameters.
    """
    _check_steps(steps, slow_steps)
    check_optimizer(optimizer, model)
    chosen = resolve_strategies(strategies)
    if baseline not in {s.name for s in chosen}:
        chosen = [*resolve_strategies([baseline]), *chosen]
    dev = torch.device(device) if device is not None else model_device(model)
    b = _Bench(model, batch_to(batch, dev), loss_fn, optimizer, dev, seed)
    runs = _runs(chosen, dev)
    wanted = _wanted(runs, dev, steps, slow_steps)
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        with configured(quiet=None if progress is None else not progress):
            _memory_phase(b, runs)
            _timed_rounds(b, runs, wanted)
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    _finish(runs, baseline)
    return [r.point for r in runs]
