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
from memfit.devices import model_device
from memfit.measuring.prices import micro_label
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
    "MOST_MICRO_BATCHES",
    "BlockInputs",
    "Fewer",
    "block_times",
    "capture_block_inputs",
    "describe_timing",
    "fewer_rows",
    "micro_batch_inputs",
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


#: The most micro-batches a block alone is timed in (a batch of more rows, in the fewest rows
#: of a micro-batch that keep it at most this many).
MOST_MICRO_BATCHES = 64

#: The block's inputs for one micro-batch, and how many micro-batches make up its rows.
Fewer = tuple[BlockInputs, int]


def fewer_rows(seen: BlockInputs, rows: int, keep: int) -> BlockInputs | None:
    """``seen`` with every tensor whose first dimension is ``rows`` cut to its first ``keep``
    rows: the block's inputs for a micro-batch of ``keep`` (None where no tensor has ``rows``
    first, or ``keep`` is not fewer).

    Example:
        >>> seen = BlockInputs((torch.ones(4, 3), torch.ones(3)), {}, seen=True)
        >>> [tuple(a.shape) for a in fewer_rows(seen, 4, 1).args]
        [(1, 3), (3,)]
    """
    cut = False

    def one(value: Any) -> Any:
        nonlocal cut
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            cut = True
            return _keep(value[:keep])
        return value

    if keep >= rows or not seen.seen:
        return None
    args, kwargs = tree_map(one, (seen.args, seen.kwargs))
    return BlockInputs(args, kwargs, seen=True) if cut else None


def micro_batch_inputs(seen: BlockInputs, rows: int) -> list[Fewer]:
    """The block's inputs for 2 micro-batches, for as many as it has ``rows`` (one row each;
    at most :data:`MOST_MICRO_BATCHES`) and for a count between them, with their counts
    (:func:`fewer_rows`; none where its inputs do not carry the rows first).

    Example:
        >>> seen = BlockInputs((torch.ones(32, 3),), {}, seen=True)
        >>> [(tuple(f.args[0].shape), k) for f, k in micro_batch_inputs(seen, 32)]
        [((16, 3), 2), ((4, 3), 8), ((1, 3), 32)]
    """
    out: list[Fewer] = []
    counts = [k for k in range(2, min(rows, MOST_MICRO_BATCHES) + 1) if rows % k == 0]
    most = counts[-1] if counts else 1
    # and the count between 2 and the most, in log k: the curve bends
    middle = min(counts[1:-1], key=lambda k: abs(math.log(k * k / (2 * most))), default=2)
    for k in sorted({2, middle, most}):
        fewer = fewer_rows(seen, rows, rows // k) if rows % k == 0 else None
        if fewer is not None:
            out.append((fewer, k))
    return out


def _timed_run(
    block: nn.Module, seen: BlockInputs, autocast: Callable[[], AbstractContextManager[Any]], cuda: bool
) -> float:
    device = model_device(block)
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    _run(block, seen, autocast)
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def time_block_modes(
    model: nn.Module,
    name: str,
    seen: BlockInputs,
    modes: Sequence[CheckpointMode],
    rounds: int,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
    within: float = math.inf,
    fewer: Sequence[Fewer] = (),
) -> dict[str, list[float]]:
    """Seconds of block ``name``'s forward + backward alone, per mode, one per round.

    One untimed round warms each mode up; then every round runs the modes in the order
    given, so the i-th times of two modes were taken side by side. ``autocast`` makes the
    context each run's forward runs in (the precision's autocast). With ``fewer`` (inputs of
    one micro-batch and a count k: :func:`micro_batch_inputs`), each round also runs the block
    without checkpointing k times on them, back to back (all its rows in k micro-batches: as
    long, so as disturbed, as the other runs), their seconds together under
    :func:`~memfit.measuring.prices.micro_label` of k (left out where the warm-up fails).
    Timing stops after the round in which ``within`` seconds have passed, once
    :data:`MIN_ROUNDS` rounds were timed
    (See Note [timing a block alone within a few steps]). The block's mode is put back to
    ``none`` (no checkpointing) afterwards.

    Raises:
        RuntimeError: the inputs were not captured, or the block's output needs no gradient.
    """
    if not seen.seen:
        raise RuntimeError(seen.error or f"block {name!r} was not called")
    block = model.get_submodule(name)
    cuda = model_device(block).type == "cuda"
    times: dict[str, list[float]] = {m: [] for m in modes}
    began = time.perf_counter()
    try:
        with progress.phase(f"timing {name} alone", total=rounds) as shown:
            for r in range(rounds + 1):
                for mode in modes:
                    set_block_modes(model, {name: mode})
                    took = _timed_run(block, seen, autocast, cuda)
                    if r > 0:
                        times[mode].append(took)
                timed = times if r > 0 else None
                fewer = [f for f in fewer if _time_fewer(model, name, f, autocast, cuda, timed)]
                if r > 0:  # round 0 warms each mode up
                    shown.advance()
                if r >= MIN_ROUNDS and time.perf_counter() - began > within:
                    break
    finally:
        set_block_modes(model, {name: "none"})
    return times


def _time_fewer(
    model: nn.Module,
    name: str,
    fewer: Fewer,
    autocast: Callable[[], AbstractContextManager[Any]],
    cuda: bool,
    times: dict[str, list[float]] | None,
) -> bool:
    """Run the block without checkpointing on one micro-batch's inputs as many times as make up
    its rows, adding their seconds to ``times`` (None: a warm-up); False where the warm-up
    failed (that count is then left out)."""
    inputs, runs = fewer
    set_block_modes(model, {name: "none"})
    block = model.get_submodule(name)
    if times is not None:
        took = sum(_timed_run(block, inputs, autocast, cuda) for _ in range(runs))
        times.setdefault(micro_label(runs), []).append(took)
        return True
    try:
        _timed_run(block, inputs, autocast, cuda)
    except Exception:  # rows the block cannot take: micro-batches stay priced by their ops
        return False
    return True


def block_times(
    model: nn.Module,
    name: str,
    seen: BlockInputs,
    modes: Sequence[CheckpointMode],
    rounds: int,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
    within: float = math.inf,
    fewer: Sequence[Fewer] = (),
) -> tuple[dict[str, list[float]], str]:
    """Block ``name``'s seconds per mode (:func:`time_block_modes`) and ``""``, or no times and
    why the block cannot run alone."""
    try:
        return time_block_modes(model, name, seen, modes, rounds, autocast, within, fewer), ""
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
