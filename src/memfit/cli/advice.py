"""What the commands recommend, kept to what ``memfit doctor`` knows about the device.

A precision the device only emulates (:func:`memfit.devices.slow_precisions`), or one the
bench measured slower than fp32 with the same checkpointing, is never recommended for
speed; it may still be named for memory, saying it is slow here.

Example:
    >>> from memfit.devices import DeviceFacts
    >>> from memfit.records import BenchPoint
    >>> cpu = DeviceFacts("cpu", "cpu", "CPU", 0, bf16_runs=True)
    >>> fp32 = BenchPoint("fp32/none", "fp32", "none", peak_bytes=100, step_seconds=1.0)
    >>> bf16 = BenchPoint("bf16/none", "bf16", "none", peak_bytes=60, step_seconds=0.5)
    >>> print(bench_advice([fp32, bf16], 80, cpu)[:75])
    for a budget of 80 B (80 bytes), the fastest measured strategy that fits is
    >>> "bf16/none (peak 60 B" in bench_advice([fp32, bf16], 80, cpu)
    True
"""

from __future__ import annotations

from collections.abc import Sequence

from memfit.benchmarking.pareto import fastest_within, recommendation
from memfit.budget import format_bytes
from memfit.devices import DeviceFacts, slow_precisions
from memfit.records import BenchPoint, EstimateEntry

__all__ = ["bench_advice", "slow_points", "speed_order"]

_FP32 = "fp32"


def slow_points(points: Sequence[BenchPoint], facts: DeviceFacts) -> dict[str, str]:
    """``{strategy: why it is slow here}`` for mixed-precision points not to recommend for speed."""
    emulated = set(slow_precisions(facts))
    fp32 = {p.checkpointing: p for p in points if p.ok and p.precision == _FP32}
    out = {}
    for p in points:
        if not p.ok or p.precision == _FP32:
            continue
        ref = fp32.get(p.checkpointing)
        if p.precision in emulated:
            out[p.strategy] = (
                f"{p.precision} is not native on {facts.name}: not reliably faster than fp32 "
                "(see memfit doctor)"
            )
        elif ref is not None and ref.step_seconds > 0 and p.step_seconds > ref.step_seconds:
            out[p.strategy] = (
                f"{p.precision} measured {p.step_seconds / ref.step_seconds:.2f}x the step time of "
                f"{ref.strategy} here"
            )
    return out


def _memory_only(
    slow: Sequence[BenchPoint], fast: Sequence[BenchPoint], budget: int | None
) -> BenchPoint | None:
    """The slow point worth naming for memory: the fastest slow one that fits where no fast one
    does, or (without a budget) the smallest overall when it is a slow one."""
    if budget is not None:
        return fastest_within(slow, budget) if fastest_within(fast, budget) is None else None
    smallest = min([*slow, *fast], key=lambda p: (p.peak_bytes, p.step_seconds), default=None)
    return smallest if smallest in slow else None


def _only_slow_fits(mem: BenchPoint, why: str, fast: Sequence[BenchPoint], budget: int) -> str:
    """The answer when what fits the budget is slow here: it fits, and what it costs."""
    smallest = min(fast, key=lambda p: (p.peak_bytes, p.step_seconds), default=None)
    other = (
        f"; none of the strategies fast here fits (the smallest is {smallest.strategy}, peak "
        f"{format_bytes(smallest.peak_bytes)})"
        if smallest is not None
        else ""
    )
    return (
        f"for a budget of {format_bytes(budget)} ({budget} bytes), the fastest measured strategy that fits "
        f"is {mem.strategy} (peak {format_bytes(mem.peak_bytes)}, {mem.peak_ratio:.2f}x; step "
        f"{mem.time_ratio:.2f}x of {mem.baseline}), but {why}: it saves memory, not time{other}."
    )


def bench_advice(points: Sequence[BenchPoint], budget: int | None, facts: DeviceFacts) -> str:
    """The bench's answer (:func:`memfit.benchmarking.pareto.recommendation`) among the strategies
    fast on this device, and the slow ones only for memory."""
    why = slow_points(points, facts)
    if not why:
        return recommendation(points, budget)
    fast = [p for p in points if p.ok and p.strategy not in why]
    slow = [p for p in points if p.ok and p.strategy in why]
    line = recommendation(fast, budget) if fast else "no strategy that is fast here could be measured."
    mem = _memory_only(slow, fast, budget)
    if mem is not None and budget is not None:
        line = _only_slow_fits(mem, why[mem.strategy], fast, budget)
    elif mem is not None:
        line += (
            f" For memory only: {mem.strategy} {'fits' if budget is not None else 'is the smallest'} "
            f"(peak {format_bytes(mem.peak_bytes)}, step {mem.time_ratio:.2f}x of {mem.baseline}), but "
            f"{why[mem.strategy]}: it saves memory, not time."
        )
    reasons: dict[str, str] = {}
    for p in slow:
        reasons.setdefault(p.precision, why[p.strategy].split(" (see")[0])
    return line + f" (not recommended for speed: {'; '.join(reasons.values())}.)"


def speed_order(entries: Sequence[EstimateEntry], facts: DeviceFacts | None) -> list[EstimateEntry]:
    """``entries`` (fastest-looking first) with the precisions ``facts`` says are emulated moved last."""
    slow = set(slow_precisions(facts)) if facts is not None else set()
    return [e for e in entries if e.precision not in slow] + [e for e in entries if e.precision in slow]
