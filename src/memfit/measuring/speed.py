"""What a FLOP, a byte, an op and a checkpoint call cost on this device: short micro-benchmarks.

The step time model (:mod:`memfit.stepmodel.time`) counts a block's work (FLOPs, bytes
written, ops dispatched) and needs the price of each: :func:`measure_speed` times a
matmul, an elementwise add, a run of tiny ops, and a tiny module through memfit's own
checkpointing (full and selective), each a few times, keeping the fastest (the least
disturbed by other work on a shared machine). It takes tens of milliseconds.

Trade-off: a micro-benchmark's matmul is not the model's matmul (shapes, cache reuse);
the model's own timed steps rescale the whole forward (``Speed.forward_scale``), so only
the ratios between the prices matter, and those are what a device's balance sets.

Example:
    >>> import torch
    >>> from memfit.precision import Precision
    >>> sp = measure_speed(torch.device("cpu"), Precision("fp32"), repeats=1)
    >>> sp.flop_seconds > 0 and sp.byte_seconds > 0 and sp.op_seconds > 0
    True
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from memfit.checkpointing import set_block_modes
from memfit.devices import free_cores, seconds_of
from memfit.precision import Precision
from memfit.records import Speed

__all__ = ["device_speed", "measure_speed", "timing_threads", "torch_threads"]

#: Tiny ops in the selective-checkpointing micro-benchmark.
_OPS = 24


def _best(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of ``repeats`` timed runs after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        best = min(best, seconds_of(fn, device))
    return best


class _Tiny(nn.Module):
    """A chain of ``ops`` elementwise ops with one parameter: dispatch-bound by design."""

    def __init__(self, ops: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.w
        for _ in range(self.ops - 1):
            h = h + 1.0
        return h


def _step(model: nn.Module, x: torch.Tensor, calls: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(calls):
            model(x).sum().backward()

    return run


def measure_speed(device: torch.device, precision: Precision, repeats: int = 3) -> Speed:
    """Micro-benchmark this device at ``precision``; returns the prices (``forward_scale`` 1).

    Args:
        device: where the model runs.
        precision: matmuls run under its autocast (bf16/fp16 matmuls are faster on GPUs).
        repeats: timed runs per benchmark; the fastest counts.
    """
    gpu = device.type == "cuda"
    n = 4096 if gpu else 256
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    with precision.autocast():
        matmul = _best(lambda: a @ b, device, repeats)
    flop_seconds = matmul / (2 * n**3)
    big = torch.randn((1 << 26) if gpu else (1 << 20), device=device)
    add = _best(lambda: big + big, device, repeats)
    byte_seconds = add / (big.numel() * big.element_size())
    one = torch.ones(1, device=device)
    tiny = 64
    ops = _best(lambda: [one + 1.0 for _ in range(tiny)], device, repeats)
    op_seconds = ops / tiny
    x = torch.ones(8, device=device, requires_grad=True)
    calls = 8
    plain = nn.Sequential(_Tiny(1)).to(device)
    t_plain = _best(_step(plain, x, calls), device, repeats)
    full = set_block_modes(nn.Sequential(_Tiny(1)).to(device), {"0": "full"})
    t_full = _best(_step(full, x, calls), device, repeats)
    checkpoint_seconds = max(0.0, (t_full - t_plain) / calls - op_seconds)
    many_full = set_block_modes(nn.Sequential(_Tiny(_OPS)).to(device), {"0": "full"})
    many_sel = set_block_modes(nn.Sequential(_Tiny(_OPS)).to(device), {"0": "selective"})
    t_many_full = _best(_step(many_full, x, 2), device, repeats)
    t_many_sel = _best(_step(many_sel, x, 2), device, repeats)
    # Both recompute the same ops (none is a matmul); the difference is the selective
    # dispatch mode's time, paid per op in the forward and again in the recompute.
    selective_op_seconds = max(0.0, (t_many_sel - t_many_full) / 2 / (2 * _OPS))
    return Speed(
        flop_seconds=flop_seconds,
        byte_seconds=byte_seconds,
        op_seconds=op_seconds,
        checkpoint_seconds=checkpoint_seconds,
        selective_op_seconds=selective_op_seconds,
    )


# Note [the device's prices once per process]
# The micro-benchmarks price the device (a FLOP, a byte, an op, a checkpoint call), not the
# model: each profile scales them to its own timed steps (Speed.forward_scale), so only
# their ratios matter. They are measured once per process, device and precision, so the
# calls of one process price work alike (a second plan of the same model does not pay for
# them again, nor get other ratios from another moment's load).


@functools.cache
def _device_speed(device: str, mode: str, threads: int) -> Speed:
    return measure_speed(torch.device(device), Precision(mode, device=device))  # type: ignore[arg-type]


def device_speed(device: torch.device, precision: Precision) -> Speed:
    """:func:`measure_speed`'s prices for this device and precision, measured once per process
    (a copy each call; See Note [the device's prices once per process]).

    Example:
        >>> a = device_speed(torch.device("cpu"), Precision("fp32"))
        >>> b = device_speed(torch.device("cpu"), Precision("fp32"))
        >>> a == b and a is not b
        True
    """
    return Speed(**_device_speed(str(device), precision.mode, torch.get_num_threads()).to_dict())


# Note [timing on the free cores]
# Torch's CPU thread pool waits at the end of every parallel op for its slowest thread. Where
# other processes keep cores busy, a pool as large as the machine has more threads than free
# cores; a thread the kernel parks then holds up every op, and a step runs 10x slower for
# seconds at a time (the README's GPT with both cores spinning: 5-second medians of 89-172 ms
# on 2 threads, one of 1,299 ms; on 1 thread 84-109 ms, as fast and steady). Timings read
# through such stalls price nothing the plan changes and take as long as they stall. So a
# plan (and memfit.profile) reads the free cores once, when it starts, and runs all its real
# steps on no more threads than there are free cores (one at least): the timed ones, the one
# that creates the optimizer's state, and the chosen plan's tracked step (MemTracker counts
# the tensors ops return, never a kernel's own scratch, so the bytes do not depend on the
# threads; the stalls hit that step as they hit the timed ones, 2.7 s against 0.4 s). The
# plan's report says so; the prices it fits are ratios between runs timed alike, and the
# micro-benchmarks are taken at that thread count too.


def timing_threads(device: torch.device) -> tuple[int, str]:
    """Threads to time steps on: torch's own count, or the free cores where other processes
    keep the rest busy (See Note [timing on the free cores]); and a line saying why where fewer.

    Example:
        >>> n, why = timing_threads(torch.device("cpu"))
        >>> 1 <= n <= torch.get_num_threads()
        True
    """
    threads = torch.get_num_threads()
    free = free_cores() if device.type == "cpu" and threads > 1 else None
    if free is None or free >= threads:
        return threads, ""
    used = max(1, free)
    why = (
        f"steps timed on {used} of {threads} CPU threads: other processes kept "
        f"{(os.cpu_count() or threads) - free} core(s) busy, and a thread pool larger than the free "
        "cores stalls at random"
    )
    return used, why


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Torch's CPU thread count set to ``threads`` while the body runs, and put back after.

    Example:
        >>> before = torch.get_num_threads()
        >>> with torch_threads(1):
        ...     torch.get_num_threads()
        1
        >>> torch.get_num_threads() == before
        True
    """
    before = torch.get_num_threads()
    if threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
