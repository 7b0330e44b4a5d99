"""What the long-context levers' prices rest on, measured: the tiled MLP's bytes, the host link.

:func:`tiled_mlp_facts` runs one of the model's MLPs alone at the step's shape (found by a
forward of the loss function stopped at the MLP), plain and tiled at each count of the
ladder, in each checkpointing mode, under MemTracker (See Note [the MLP measured alone]);
:func:`host_link_facts` times copies between the device and pinned host memory (refused on a
CPU, whose activations are in host memory already).

Example:
    >>> import torch
    >>> from memfit.models.llama import llama
    >>> spec = llama(preset="tiny", block_size=64)
    >>> x, y = spec.random_batch(2, seed=0)
    >>> facts = tiled_mlp_facts(spec.model, (x, y), spec.loss_fn, "fp32")
    >>> facts.rows, facts.positions, facts.hidden, facts.chunk_counts
    (2, 64, 32, [2, 4, 8, 16, 32, 64])
    >>> facts.tiled[-1]["full"].backward_peak_bytes < facts.plain["full"].backward_peak_bytes
    True
    >>> host_link_facts(torch.device("cpu")).refused[:40]
    'activations offloaded on a CPU stay in i'
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from memfit.checkpointing import uncheckpoint
from memfit.checkpointing.compile import eager
from memfit.checkpointing.recompute import run_checkpointed
from memfit.devices import model_device
from memfit.errors import ConfigError
from memfit.levers.tiled_mlp import find_mlps, install_tiled_mlp, remove_tiled_mlp, tiled_call
from memfit.measuring.preserve import create_optimizer_state
from memfit.measuring.repeated_blocks import skipping, steps_per_mode
from memfit.measuring.tracker import PhaseTracker
from memfit.measuring.twin import Twin, make_twin, twin_precision
from memfit.precision import Precision
from memfit.records import Profile
from memfit.records.long_context import HostLinkFacts, MlpCost, TiledMlpFacts
from memfit.stepmodel.tiled_mlp import floor_of, mlp_chunk_counts
from memfit.vocab import CHECKPOINT_MODES, CheckpointMode

__all__ = ["attach_tiled_floor", "host_link_facts", "mlp_cost", "mlp_input", "tiled_floor", "tiled_mlp_facts"]

# Note [the MLP measured alone]
# The tiled MLP's bytes are predicted, not measured on the whole step: the model's first MLP
# runs alone on an input of the step's shape and dtype (seeded), plain and tiled at each chunk
# count of the ladder (Note [the tiled MLP's bytes between measured counts]), in each
# checkpointing mode (the MLP checkpointed alone as its block would be), under MemTracker;
# the differences move the blocks' numbers (memfit.stepmodel.tiled_mlp). Its output goes into
# a residual add, as in the block: the MLP's own output is freed there unless something keeps
# it (selective checkpointing keeps a matmul's output), the sum's bytes are taken out of what
# is kept and of the backward's peak (the block's output, counted by the block). The incoming
# gradient is made before the count starts (in the block it exists already). The MLP's input
# is made from a copy after the start (inside the checkpointed region, in the checkpointed
# modes) and dropped at once, as a norm's output in the block: it is counted as kept only
# where the MLP's backward keeps it (the tiled MLP does; a bf16 MLP keeps its bf16 casts
# instead); what is kept is counted after autocast's cache is cleared (the forward's end:
# weight casts the backward saves stay, the others go). The parameters' gradients are put
# back afterwards. Every MLP of a decoder has one shape, so one stands for all.


class _Stop(Exception):
    """Raised at the MLP's input to end the shape-finding forward there."""


def mlp_input(
    model: nn.Module, module: nn.Module, batch: Any, loss_fn: Callable[..., Any], precision: str
) -> tuple[torch.Size, torch.dtype] | None:
    """The shape and dtype of ``module``'s input in one step (None: the loss never called it)."""
    seen: dict[str, torch.Tensor] = {}

    def hook(_: nn.Module, args: Any) -> None:
        if args and isinstance(args[0], torch.Tensor):
            seen["x"] = args[0]
        raise _Stop

    handle = module.register_forward_pre_hook(hook)
    device = next(module.parameters()).device
    try:
        with torch.no_grad(), Precision(precision, device).autocast():  # type: ignore[arg-type]
            loss_fn(model, batch)
    except _Stop:
        pass
    finally:
        handle.remove()
    x = seen.get("x")
    return None if x is None else (x.shape, x.dtype)


@contextlib.contextmanager
def _own_grads(module: nn.Module) -> Iterator[None]:
    params = list(module.parameters())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g


class _Alone(nn.Module):
    """Calls the MLP under a module of its own: MemTracker takes a module called twice at the top
    level (a tiled MLP's Linear, once per chunk) for a second iteration."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _runner(module: nn.Module, mode: str, chunks: int) -> Callable[[torch.Tensor], torch.Tensor]:
    forward = types.MethodType(type(module).forward, module)  # the module as written
    params = list(module.parameters())
    fn: Callable[[torch.Tensor], torch.Tensor] = (
        forward if chunks <= 1 else functools.partial(_tiled, forward, chunks, params)
    )
    fn = functools.partial(_from_copy, fn)
    if mode != "none":
        fn = functools.partial(_checkpointed, fn, module, mode)
    return _Alone(fn)


def _from_copy(fn: Callable[[torch.Tensor], torch.Tensor], leaf: torch.Tensor) -> torch.Tensor:
    return fn(leaf * 1.0)  # the MLP's input, made and dropped as in the block (a norm's output)


def _tiled(forward: Any, chunks: int, params: list[nn.Parameter], x: torch.Tensor) -> torch.Tensor:
    return tiled_call(forward, x, chunks, params)


def _checkpointed(fn: Any, module: nn.Module, mode: str, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = run_checkpointed(fn, module, mode, (x,), {})  # type: ignore[arg-type]
    return out


def mlp_cost(
    module: nn.Module, shape: Sequence[int], dtype: torch.dtype, precision: str, mode: str, chunks: int
) -> MlpCost:
    """MemTracker's bytes of ``module`` alone on an input of ``shape`` in ``mode`` at ``chunks``
    chunks (1: plain), See Note [the MLP measured alone]."""
    device = next(module.parameters()).device
    run = _runner(module, mode, chunks)
    cast = Precision(precision, device)  # type: ignore[arg-type]
    with torch.no_grad(), cast.autocast():
        one = torch.zeros(*shape[:-2], 1, shape[-1], device=device, dtype=dtype)
        width = types.MethodType(type(module).forward, module)(one).shape[-1]
    tracker = PhaseTracker(device, {}, {})
    tracker.track_external(module)
    with _own_grads(module), eager(), tracker:
        torch.manual_seed(0)  # made inside, so that MemTracker counts them before the start
        leaf = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
        residual = torch.randn(*shape[:-1], width, device=device, dtype=dtype)
        grad = torch.randn_like(residual)
        tracker.enter_phase("mlp forward")
        start = tracker.total()
        with cast.autocast():
            y = residual + run(leaf)
            held = tracker.total() - start - (out := y.numel() * y.element_size())
        kept = tracker.total() - start - out
        tracker.enter_phase("mlp backward")
        y.backward(grad)
    peaks = tracker.phase_peak
    return MlpCost(kept, peaks["mlp forward"] - start, peaks["mlp backward"] - start - out, held)


def tiled_mlp_facts(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[..., Any],
    precision: str,
    names: Sequence[str] | None = None,
    modes: Sequence[str] = CHECKPOINT_MODES,
    last_only: bool = False,
) -> TiledMlpFacts:
    """One MLP of ``model`` at one step's shape of ``loss_fn(model, batch)``, plain and tiled at
    each count of the ladder (:func:`memfit.stepmodel.tiled_mlp.mlp_chunk_counts`; with
    ``last_only``, its last count alone: what the lever saves at most), in ``modes``;
    ``refused`` says why the tiled MLP cannot run instead (no MLP found, never called, no
    sequence to split). The model's gradients and RNG are as they were."""
    try:
        modules = find_mlps(model, names)
    except ConfigError as exc:
        return TiledMlpFacts(refused=str(exc))
    first = model.get_submodule(modules[0])
    with torch.random.fork_rng(devices=[]):
        found = mlp_input(model, first, batch, loss_fn, precision)
    if found is None or len(found[0]) < 2:
        why = "never called it" if found is None else f"gave it a {len(found[0])}-dimensional input"
        return TiledMlpFacts(
            modules=modules, refused=f"the loss function {why}, so there is no sequence to tile."
        )
    shape, dtype = found
    facts = TiledMlpFacts(modules=modules, rows=shape[:-2].numel(), positions=shape[-2], hidden=shape[-1])
    facts.chunk_counts = (
        mlp_chunk_counts(facts.positions)[-1:] if last_only else mlp_chunk_counts(facts.positions)
    )
    with torch.random.fork_rng(devices=[]):
        facts.plain = {m: mlp_cost(first, shape, dtype, precision, m, 1) for m in modes}
        facts.tiled = [
            {m: mlp_cost(first, shape, dtype, precision, m, n) for m in modes} for n in facts.chunk_counts
        ]
    return facts


def _floor_target(profile: Profile) -> TiledMlpFacts | None:
    """The profile's tiled MLP facts where a floor can be measured (a ladder, blocks)."""
    tiled = profile.lever_facts.tiled_mlp if profile.lever_facts is not None else None
    if tiled is None or tiled.refused or not tiled.chunk_counts or not profile.blocks:
        return None
    return tiled


def tiled_floor(
    twin: Twin,
    loss_fn: Callable[..., Any],
    precision: Precision,
    profile: Profile,
    blocks: Sequence[str],
    stand_in: Mapping[str, str] | None = None,
) -> None:
    """Set ``profile``'s :attr:`TiledMlpFacts.floor`: every block's numbers with every MLP of
    ``twin``'s model tiled at the ladder's last count, one fake step per mode the profile has
    (See Note [a tiled MLP in its block] in :mod:`memfit.stepmodel.tiled_mlp`); nothing where
    the tiled MLP is refused or has no ladder. The blocks ``stand_in`` names pass their input
    through and take the numbers of the block it maps them to (identical residual blocks, as
    :func:`memfit.measuring.repeated_blocks.fast_profiles` runs them: two of Llama 8B's 32).
    The twin is left as it was (its MLPs plain, its blocks not checkpointed).

    Example:
        >>> from memfit.measuring.fake_profile import memory_profile
        >>> from memfit.measuring.twin import make_twin
        >>> from memfit.models.llama import llama
        >>> from memfit.records import LeverFacts
        >>> spec = llama(preset="tiny", n_layer=2)
        >>> batch = spec.random_batch(2, seed=0)
        >>> prof = memory_profile(spec.model, batch, spec.loss_fn, None, "fp32")
        >>> facts = tiled_mlp_facts(spec.model, batch, spec.loss_fn, "fp32", last_only=True)
        >>> prof.lever_facts = LeverFacts(tiled_mlp=facts)
        >>> twin = make_twin(spec.model, None, batch)
        >>> tiled_floor(twin, spec.loss_fn, Precision("fp32"), prof, ["blocks.0", "blocks.1"])
        >>> sorted(facts.floor["blocks.1"])
        ['backward_peak_bytes', 'forward_peak_bytes', 'held_bytes', 'saved_bytes']
        >>> sorted(facts.floor["blocks.1"]["backward_peak_bytes"])
        ['full', 'none', 'selective']
    """
    tiled = _floor_target(profile)
    if tiled is None:
        return
    skipped = dict(stand_in or {})
    with twin.running(), skipping(twin.model, list(skipped)):
        install_tiled_mlp(twin.model, tiled.chunk_counts[-1])
        try:
            create_optimizer_state(twin.model, twin.optimizer)
            modes = [cast(CheckpointMode, m) for m in profile.blocks[0].saved_bytes]
            what = f"the tiled MLP's floor in {tiled.chunk_counts[-1]} chunks, steps per checkpointing mode"
            step = (twin.batch, loss_fn)
            fake = twin_precision(precision)
            floor = steps_per_mode(twin.model, step, twin.optimizer, fake, list(blocks), modes, skipped, what)
        finally:
            uncheckpoint(twin.model)
            remove_tiled_mlp(twin.model)
    tiled.floor = floor_of(floor)


def attach_tiled_floor(
    profile: Profile,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    blocks: Sequence[str],
    step: tuple[Any, Callable[..., Any]],
) -> None:
    """:func:`tiled_floor` on a fake twin of ``model`` (the tiled MLP's facts measured already);
    the floor stays empty where the twin cannot run."""
    if _floor_target(profile) is None:
        return
    precision = Precision(profile.precision, device=model_device(model))  # type: ignore[arg-type]
    with contextlib.suppress(Exception):  # a model fake tensors cannot run: the MLP's difference alone
        tiled_floor(make_twin(model, optimizer, step[0]), step[1], precision, profile, blocks)


# Note [the host link timed]
# Offloaded activations cross the link between device and host memory twice. Its speed is
# timed on the device: a buffer of probe_bytes copied to pinned host memory and back on a
# side stream, each way the median of a few copies after one to warm up, as the offload lever
# copies (memfit.levers.offload). On a CPU there is no link: the lever is refused there.


def host_link_facts(device: torch.device, probe_bytes: int = 64 * 2**20, repeats: int = 5) -> HostLinkFacts:
    """The speed of copies between ``device`` and pinned host memory (See Note [the host link timed])."""
    if device.type != "cuda":
        return HostLinkFacts(
            device=str(device),
            refused="activations offloaded on a CPU stay in its memory: there is no device memory to free.",
        )
    buf = torch.empty(probe_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(probe_bytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream(device)
    out = [_timed(stream, host, buf, repeats), _timed(stream, buf, host, repeats)]
    return HostLinkFacts(str(device), probe_bytes / out[0], probe_bytes / out[1], probe_bytes)


def _timed(stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()
        times.append(time.perf_counter() - started)
    return max(statistics.median(times[1:]), 1e-9)
