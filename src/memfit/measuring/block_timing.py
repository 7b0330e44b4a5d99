"""One block timed on its own, in each checkpointing mode: what a recompute really costs.

The step model counts each block's work; what a recompute and selective checkpointing's
dispatch cost per unit of that work is a property of the model on this device (a CPU
recomputes a block faster than its first forward, with warm caches; GELU's arithmetic and
the cached outputs handed back cost selective more than an add). Whole steps are a poor
ruler for that: a step's noise (a few percent) is as large as one block's recompute.
:func:`capture_block_inputs` keeps the inputs one block saw in a real step, and
:func:`time_block_modes` runs that block's forward and backward alone, many times, its
modes interleaved (none, selective, full, none, ...), so each difference is taken between
adjacent runs of a fraction of a step.

Trade-off: one block stands for its kind (the planner's blocks of one class and shape are
identical; others are scaled by their counted work), and objects a block reads and
changes (an HF cache) are copied before every run, so each run starts from the same state.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    >>> x = torch.randn(4, 8)
    >>> with capture_block_inputs(model, "0") as seen:
    ...     _ = model(x)
    >>> times = time_block_modes(model, "0", seen, ["none", "full"], rounds=2)
    >>> sorted(times)
    ['full', 'none']
    >>> all(len(t) == 2 for t in times.values())
    True
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from memfit import progress
from memfit.checkpointing import set_block_modes
from memfit.devices import model_device, seconds_of
from memfit.vocab import CheckpointMode

#: Rounds a block alone is timed in each mode at least, however long they take.
MIN_ROUNDS = 3
#: Whole steps' seconds the profile spends at most (after MIN_ROUNDS) timing a block alone.
BLOCK_STEPS = 4.0

# Note [timing a block alone within a few steps]
# A block timed alone prices a recompute and selective checkpointing; more rounds only
# narrow a median. On a model of many small blocks (a CNN) a block alone, warmed up and
# run in three modes, costs as much as whole steps, so the profile stops after a few
# steps' worth of seconds: planning stays within its goal of about 30 baseline steps.

__all__ = [
    "BLOCK_STEPS",
    "MIN_ROUNDS",
    "BlockInputs",
    "block_times",
    "capture_block_inputs",
    "describe_timing",
    "time_block_modes",
]


@dataclass
class BlockInputs:
    """What one block was called with in a real step (empty until it was called)."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    seen: bool = False
    error: str = ""
    """Why the inputs could not be kept (then the block cannot be timed alone)."""


def _keep(value: Any) -> Any:
    """A tensor detached (as a leaf that requires grad where the original did); anything else copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return copy.deepcopy(value)


@contextmanager
def capture_block_inputs(model: nn.Module, name: str) -> Iterator[BlockInputs]:
    """Keep the arguments block ``name`` is first called with while the body runs."""
    seen = BlockInputs()

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if seen.seen or seen.error:
            return
        try:
            seen.args, seen.kwargs = tree_map(_keep, (args, kwargs))
            seen.seen = True
        except Exception as exc:  # a value that cannot be copied: the block is not timed alone
            seen.error = f"{type(exc).__name__}: {exc}"

    handle = model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def _fresh(seen: BlockInputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The inputs for one run: tensors shared (leaves, their grads dropped), objects copied anew."""

    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            value.grad = None
            return value
        return copy.deepcopy(value)

    args, kwargs = tree_map(one, (seen.args, seen.kwargs))
    return args, kwargs


def _run(block: nn.Module, seen: BlockInputs, autocast: Callable[[], AbstractContextManager[Any]]) -> None:
    args, kwargs = _fresh(seen)
    with autocast():
        out = block(*args, **kwargs)
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise RuntimeError("the block's output needs no gradient")
    torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])


def _timed_run(
    block: nn.Module, seen: BlockInputs, autocast: Callable[[], AbstractContextManager[Any]]
) -> float:
    return seconds_of(lambda: _run(block, seen, autocast), model_device(block))


def time_block_modes(
    model: nn.Module,
    name: str,
    seen: BlockInputs,
    modes: Sequence[CheckpointMode],
    rounds: int,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
    within: float = math.inf,
) -> dict[str, list[float]]:
    """Seconds of block ``name``'s forward + backward alone, per mode, one per round.

    One untimed round warms each mode up; then every round runs the modes in the order
    given, so the i-th times of two modes were taken side by side. ``autocast`` makes the
    context each run's forward runs in (the precision's autocast). Timing stops after the
    round in which ``within`` seconds have passed, once :data:`MIN_ROUNDS` rounds were timed
    (See Note [timing a block alone within a few steps]). The block's mode is put back to
    ``none`` (no checkpointing) afterwards.

    Raises:
        RuntimeError: the inputs were not captured, or the block's output needs no gradient.
    """
    if not seen.seen:
        raise RuntimeError(seen.error or f"block {name!r} was not called")
    block = model.get_submodule(name)
    times: dict[str, list[float]] = {m: [] for m in modes}
    began = time.perf_counter()
    try:
        with progress.phase(f"timing {name} alone", total=rounds) as shown:
            for r in range(rounds + 1):
                for mode in modes:
                    set_block_modes(model, {name: mode})
                    took = _timed_run(block, seen, autocast)
                    if r > 0:
                        times[mode].append(took)
                if r > 0:  # round 0 warms each mode up
                    shown.advance()
                if r >= MIN_ROUNDS and time.perf_counter() - began > within:
                    break
    finally:
        set_block_modes(model, {name: "none"})
    return times


def block_times(
    model: nn.Module,
    name: str,
    seen: BlockInputs,
    modes: Sequence[CheckpointMode],
    rounds: int,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
    within: float = math.inf,
) -> tuple[dict[str, list[float]], str]:
    """Block ``name``'s seconds per mode (:func:`time_block_modes`) and ``""``, or no times and
    why the block cannot run alone."""
    try:
        return time_block_modes(model, name, seen, modes, rounds, autocast, within), ""
    except Exception as exc:  # whatever stops one block running alone, the step still runs
        return {}, f"{type(exc).__name__}: {exc}"


def describe_timing(mode: str, micro_batches: int, lever: str = "") -> str:
    """How whole steps were timed, for the profile's report ("" : the plain step); ``lever``
    describes the lever they ran with ("": none).

    Example:
        >>> describe_timing("none", 4)
        ' without checkpointing in 4 micro-batches (the plain step does not fit)'
        >>> describe_timing("full", 1, "the head in chunks")
        ' with every block fully checkpointed, the head in chunks (the plain step does not fit)'
    """
    if (mode, micro_batches, lever) == ("none", 1, ""):
        return ""
    parts = f" in {micro_batches} micro-batches" if micro_batches > 1 else ""
    how = "without checkpointing" if mode == "none" else "with every block fully checkpointed"
    return f" {how}{parts}{', ' + lever if lever else ''} (the plain step does not fit)"
