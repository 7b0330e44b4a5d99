"""A position-wise sub-module (a block's MLP) run over chunks of the sequence: the tiled MLP.

At long context one decoder block's MLP makes the largest tensors of the step: its
intermediate is ``sequence x intermediate`` (2.7 to 3.5 times the residual stream), made as
two or three tensors and, under checkpointing, made again in the block's recompute.
:func:`tiled_call` computes a position-wise function over chunks of the sequence instead:
each chunk's intermediate is made, used and freed in the forward, and made again chunk by
chunk in the backward, so the whole intermediate never exists (the tiled MLP of Arctic Long
Sequence Training and Unsloth). :func:`install_tiled_mlp` makes a model's MLPs run that
way, undoably (:func:`remove_tiled_mlp`); :func:`find_mlps` finds them.

Trade-off: the MLP's intermediate shrinks from the sequence's to one chunk's, for one more
forward of the MLP (its recompute in the backward) and one Python iteration per chunk; the
MLP's weight gradients are sums over chunks (See Note [the tiled MLP's gradients]).

Example:
    >>> import torch
    >>> from memfit.models.llama import llama
    >>> spec = llama(preset="tiny")
    >>> x, y = spec.random_batch(2, seed=0)
    >>> plain = spec.loss_fn(spec.model, (x, y))
    >>> install_tiled_mlp(spec.model, chunks=4)
    ['blocks.0.mlp', 'blocks.1.mlp']
    >>> torch.testing.assert_close(spec.loss_fn(spec.model, (x, y)), plain)
    >>> remove_tiled_mlp(spec.model); tiled_mlps(spec.model)
    {}
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from memfit.checkpointing.blocks import find_blocks
from memfit.checkpointing.layers import forward_layers, set_forward_layer
from memfit.checkpointing.policy import recompute_region
from memfit.errors import ConfigError

__all__ = [
    "MLP_NAMES",
    "TiledLayer",
    "chunk_spans",
    "find_mlps",
    "install_tiled_mlp",
    "remove_tiled_mlp",
    "tiled_call",
    "tiled_mlps",
]

_TAG = "tiled_mlp"
#: Names a block's MLP goes by (Hugging Face decoders and memfit's models: ``mlp``).
MLP_NAMES = ("mlp", "feed_forward", "ffn", "feedforward")
_SUFFIXES = ("MLP", "FeedForward", "FFN")


def chunk_spans(length: int, chunks: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each chunk of ``length`` positions in ``chunks`` chunks, the first
    ones one longer where they do not divide (``torch.tensor_split``'s rule; at most one chunk
    per position).

    Example:
        >>> chunk_spans(10, 4)
        [(0, 3), (3, 3), (6, 2), (8, 2)]
    """
    n = max(1, min(chunks, length))
    q, r = divmod(length, n)
    spans, start = [], 0
    for i in range(n):
        size = q + (1 if i < r else 0)
        spans.append((start, size))
        start += size
    return spans


# Note [the tiled MLP's gradients]
# The forward runs each chunk under no_grad and keeps only the input; the backward runs each
# chunk again with grad on a detached slice of the input and asks autograd for the gradients
# of that slice and of the module's trainable parameters (LoRA adapters included). The input's
# gradient is written slice by slice into one tensor: each position's gradient goes through
# the same ops as in the plain module (in fp32 equal, or a last-bit difference where a matmul
# of a few rows takes another kernel). A parameter's gradient is the sum of its chunks'
# (returned once, so a gradient hook or a fused optimizer step sees one gradient, as with the
# plain module): the same terms summed in another order, equal to rounding (fp32: a few ulps).
# Under bf16 autocast a matmul's result can depend on how many rows it has (the kernel's
# blocking) and each chunk's weight gradient is rounded to bf16 before the sum, so gradients
# differ from the plain module's by about a bf16 rounding, less than bf16 differs from fp32
# (tested). While the sum is made, one chunk's parameter gradients exist beside it. The chunk
# a recompute starts from is a view of a detached slice, not a leaf: FlopCounterMode's module
# tracker hooks every module input that needs a gradient, and such a hook cannot run on a leaf
# inside autograd.grad. The forward's autocast state and RNG state are replayed (dropout draws
# the same masks, in chunk order), and every chunk runs in a recompute_region so that
# selective checkpointing does not keep the chunks' matmul outputs
# (See Note [ops selective checkpointing must not keep]). Under block checkpointing the
# block's recompute runs the chunked forward once more: three forwards of the MLP in all.


@dataclass(frozen=True)
class _Run:
    """What the backward replays: the function, the chunks, the forward's autocast and RNG state."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    spans: tuple[tuple[int, int], ...]
    dim: int
    autocast: tuple[bool, torch.dtype, bool]
    rng: tuple[torch.Tensor, torch.Tensor | None]


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: _Run, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.params = run, params
        ctx.save_for_backward(x)
        out: torch.Tensor | None = None
        plain = x.detach()  # chunks that are views of a grad-requiring input confuse module hooks
        with recompute_region():
            for start, size in run.spans:
                y = run.fn(plain.narrow(run.dim, start, size))
                out = _place(out, y, x, run.dim, start, size)
                del y
        assert out is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        run: _Run = ctx.run
        (x,) = ctx.saved_tensors
        need_x, need_p = ctx.needs_input_grad[1], ctx.needs_input_grad[2:]
        grad_x = torch.empty_like(x) if need_x else None
        params = [p for p, n in zip(ctx.params, need_p, strict=True) if n]
        sums: list[torch.Tensor | None] = [None] * len(params)
        with _Replay(run, x.device), recompute_region():
            for start, size in run.spans:
                piece = x.narrow(run.dim, start, size).detach().requires_grad_(need_x)
                if (
                    need_x
                ):  # not a leaf: module trackers hook a module's inputs (Note [the tiled MLP's gradients])
                    piece = piece.view_as(piece)
                y = run.fn(piece)
                wanted = ([piece] if need_x else []) + params
                grads = torch.autograd.grad(
                    y, wanted, grad_out.narrow(run.dim, start, size), allow_unused=True
                )
                del y
                if grad_x is not None:
                    grad_x.narrow(run.dim, start, size).copy_(grads[0])
                _accumulate(sums, grads[1:] if need_x else grads)
                del grads, piece  # freed before the next chunk (Note [the tiled MLP's gradients])
        it = iter(sums)
        return (None, grad_x, *(next(it) if n else None for n in need_p))


def _place(
    out: torch.Tensor | None, y: Any, x: torch.Tensor, dim: int, start: int, size: int
) -> torch.Tensor:
    """Write one chunk's output into the whole output (made at the first chunk)."""
    want = (*x.shape[:dim], size)
    if not isinstance(y, torch.Tensor) or y.ndim != x.ndim or tuple(y.shape[: dim + 1]) != want:
        got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        raise ConfigError(
            "the tiled MLP needs a position-wise module that returns one tensor shaped like its input "
            f"but for the last dimension; for an input chunk of shape {(*want, x.shape[-1])} it "
            f"returned {got}: name another module."
        )
    if out is None:
        shape = list(y.shape)
        shape[dim] = x.shape[dim]
        out = y.new_empty(shape)
    out.narrow(dim, start, size).copy_(y)
    return out


def _accumulate(sums: list[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
    for i, g in enumerate(grads):
        if g is None:
            continue
        current = sums[i]
        sums[i] = g if current is None else current.add_(g)


class _Replay:
    """The forward's autocast and RNG state, for the backward's recompute (RNG restored after)."""

    def __init__(self, run: _Run, device: torch.device) -> None:
        self.run, self.device = run, device
        self._fork: Any = None
        self._cast: Any = None

    def __enter__(self) -> None:
        devices = [self.device] if self.run.rng[1] is not None else []
        self._fork = torch.random.fork_rng(devices=devices)
        self._fork.__enter__()
        cpu, dev = self.run.rng
        torch.set_rng_state(cpu)
        if dev is not None:
            torch.cuda.set_rng_state(dev, self.device)
        enabled, dtype, cache = self.run.autocast
        self._cast = torch.autocast(self.device.type, dtype=dtype, enabled=enabled, cache_enabled=cache)
        self._grad = torch.enable_grad()
        self._grad.__enter__()
        self._cast.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._cast.__exit__(*exc)
        self._grad.__exit__(*exc)
        self._fork.__exit__(*exc)


def _state(
    device: torch.device,
) -> tuple[tuple[bool, torch.dtype, bool], tuple[torch.Tensor, torch.Tensor | None]]:
    kind = device.type
    cast = (
        torch.is_autocast_enabled(kind),
        torch.get_autocast_dtype(kind),
        torch.is_autocast_cache_enabled(),
    )
    dev = torch.cuda.get_rng_state(device) if kind == "cuda" and torch.cuda.is_available() else None
    return cast, (torch.get_rng_state(), dev)


def tiled_call(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    chunks: int,
    params: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """``fn(x)`` for a position-wise ``fn``, computed over ``chunks`` chunks of ``x``'s sequence
    dimension (the one before the last), each chunk recomputed in the backward.

    Args:
        fn: maps ``[..., t, features]`` to ``[..., t, out_features]``, each position on its own.
        x: its input, at least 2-D.
        chunks: how many chunks (at most one per position; 1 calls ``fn`` as it is).
        params: every tensor ``fn`` reads that needs a gradient (a module's parameters): their
            gradients are the sums over chunks (Note [the tiled MLP's gradients]).

    Returns:
        ``fn(x)``, equal to it position by position.

    Example:
        >>> lin = torch.nn.Linear(4, 6)
        >>> x = torch.randn(2, 5, 4)
        >>> torch.testing.assert_close(tiled_call(lin, x, 3, list(lin.parameters())), lin(x))
    """
    if x.ndim < 2:
        raise ConfigError(
            f"the tiled MLP chunks the sequence dimension (the one before the last), but its input "
            f"has shape {tuple(x.shape)}: name a module whose input is [batch, sequence, features]."
        )
    dim = x.ndim - 2
    spans = chunk_spans(x.shape[dim], chunks)
    if len(spans) == 1:
        return fn(x)
    cast, rng = _state(x.device)
    run = _Run(fn, tuple(spans), dim, cast, rng)
    trainable = [p for p in params if p.requires_grad]
    out: torch.Tensor = _Tiled.apply(run, x, *trainable)
    return out


@dataclass(frozen=True)
class TiledLayer:
    """What a tiled module's forward layer holds: the module and its chunk count."""

    module: nn.Module
    chunks: int


_CHECKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _tiled_forward(inner: Callable[..., Any], layer: TiledLayer, *args: Any, **kwargs: Any) -> Any:
    module = layer.module
    if len(args) != 1 or not isinstance(args[0], torch.Tensor) or _tensors(kwargs):
        raise ConfigError(
            f"the tiled MLP runs a module on one tensor, but {type(module).__name__} was called with "
            f"{len(args)} positional and {len(kwargs)} keyword arguments: name a module called as module(x)."
        )
    x = args[0]
    fn = functools.partial(_call_with, inner, kwargs)
    if module not in _CHECKED and x.ndim >= 2 and x.shape[-2] >= 2 and _check_position_wise(module, fn, x):
        _CHECKED.add(module)
    return tiled_call(fn, x, layer.chunks, list(module.parameters()))


def _call_with(inner: Callable[..., Any], kwargs: dict[str, Any], x: torch.Tensor) -> Any:
    return inner(x, **kwargs)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


# Note [what position-wise means here]
# Chunking the sequence is right only for a module whose output at a position depends on its
# input at that position alone and that reads no trainable tensor from outside itself. The
# first call of a tiled module checks both on a probe of its own input (one row, at most
# three positions, the module in eval mode so dropout draws nothing, the RNG untouched): the
# autograd graph's leaves must be the module's own parameters, and changing the first
# position must leave the others' outputs as they were. The probe is no part of the step:
# it runs with every dispatch mode set aside (a checkpoint's selective-checkpoint counters,
# MemTracker: a few bytes for three positions), keeps what autograd saves to itself (a
# checkpoint's saved-tensor count) and puts no weight cast in autocast's cache, so the
# forward and the recompute of a checkpointed block run the same ops. Under fake tensors
# (estimates) and torch.compile it is left out.


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _check_position_wise(module: nn.Module, fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> bool:
    """Check ``module`` on a probe of ``x``; False where it cannot be checked now."""
    if not _has_values(x) or torch.compiler.is_compiling():
        return False
    dim = x.ndim - 2
    probe = x.detach()
    for d in range(dim):
        probe = probe.narrow(d, 0, 1)
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)  # the step's own casts are cached as they would be
    try:
        with _disable_current_modes(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            probe = probe.narrow(dim, 0, min(3, x.shape[dim])).clone()
            with (
                torch.random.fork_rng(
                    devices=[x.device] if x.device.type == "cuda" and torch.cuda.is_available() else []
                ),
                torch.enable_grad(),
            ):
                y = fn(probe)
                _check_leaves(module, y)
                bumped = probe.clone()
                bumped.narrow(dim, 0, 1).add_(1.0)
                _check_positions(module, y, fn(bumped), dim)
    finally:
        torch.set_autocast_cache_enabled(cache)
        for m, training in modes:
            m.training = training
    return True


def _has_values(t: torch.Tensor) -> bool:
    return not is_fake(t) and t.device.type != "meta"


def _check_leaves(module: nn.Module, y: Any) -> None:
    own = {id(p) for p in module.parameters()}
    stack = [t.grad_fn for t in _tensors(y)]
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None and id(leaf) not in own:
            raise ConfigError(
                f"{type(module).__name__} reads a trainable tensor of shape {tuple(leaf.shape)} from "
                "outside itself, whose gradient the tiled MLP would not compute: name a module that "
                "holds every weight it uses."
            )
        stack.extend(f for f, _ in node.next_functions)


def _check_positions(module: nn.Module, y: Any, bumped: Any, dim: int) -> None:
    if not isinstance(y, torch.Tensor) or not isinstance(bumped, torch.Tensor) or y.ndim <= dim:
        return  # _place names the bad output
    rest, moved = (
        y.detach().narrow(dim, 1, y.shape[dim] - 1),
        bumped.detach().narrow(dim, 1, y.shape[dim] - 1),
    )
    if not torch.allclose(rest.float(), moved.float(), rtol=1e-3, atol=1e-5):
        raise ConfigError(
            f"{type(module).__name__} is not position-wise (changing the input at one position changed its "
            "output at others), so it cannot run over chunks of the sequence: name an MLP, not attention "
            "or a convolution."
        )


def _block_mlp(model: nn.Module, block: str) -> str:
    module = model.get_submodule(block)
    children = dict(module.named_children())
    for name in MLP_NAMES:
        if name in children:
            return f"{block}.{name}"
    named = [n for n, c in children.items() if type(c).__name__.endswith(_SUFFIXES)]
    if len(named) == 1:
        return f"{block}.{named[0]}"
    raise ConfigError(
        f"block {block} ({type(module).__name__}) has no child the tiled MLP knows as its MLP (named "
        f"{', '.join(MLP_NAMES)}, or one class named *MLP): name the module with names=[...]."
    )


def _named(model: nn.Module, name: str) -> list[str]:
    modules = dict(model.named_modules())
    if name in modules and name:
        return [name]
    by_class = [n for n, m in modules.items() if type(m).__name__ == name]
    if by_class:
        return by_class
    raise ConfigError(
        f"{type(model).__name__} has no module or module class named {name!r} to tile; name one of its "
        "modules by its qualified name (e.g. model.layers.0.mlp) or its class (e.g. LlamaMLP)."
    )


def find_mlps(model: nn.Module, names: Sequence[str] | None = None) -> list[str]:
    """Qualified names of the modules the tiled MLP runs: each block's MLP, or those named.

    Args:
        model: any ``nn.Module``.
        names: qualified module names or class names; None: the child named ``mlp`` (or
            ``feed_forward``, ``ffn``; else the one child whose class ends in ``MLP``) of each
            block :func:`memfit.find_blocks` finds (Hugging Face decoders, memfit's GPT and LLaMA).

    Raises:
        ConfigError: a name matches no module, no block was found, or a block has no MLP.

    Example:
        >>> from memfit.models.gpt import GPT, GPTConfig
        >>> find_mlps(GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)))
        ['blocks.0.mlp', 'blocks.1.mlp']
    """
    if names is not None:
        return list(dict.fromkeys(n for name in names for n in _named(model, name)))
    blocks = find_blocks(model)
    if not blocks:
        raise ConfigError(
            f"found no repeated blocks in {type(model).__name__}, so no MLP to tile: name the "
            "position-wise modules with names=[...]."
        )
    return [_block_mlp(model, b) for b in blocks]


def install_tiled_mlp(model: nn.Module, chunks: int, names: Sequence[str] | None = None) -> list[str]:
    """Run the MLPs of ``model`` (or the modules named) over ``chunks`` chunks of the sequence.

    Undone by :func:`remove_tiled_mlp` (the modules' forward is restored); installing again
    replaces the chunk count. The first call of each module checks it is position-wise
    (Note [what position-wise means here]).

    Args:
        model: the model; its module tree and state_dict do not change.
        chunks: chunks per sequence (1: run as written).
        names: see :func:`find_mlps`.

    Returns:
        The qualified names of the modules now tiled.
    """
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ConfigError(f"the tiled MLP's chunk count must be a positive integer, got {chunks!r}.")
    found = find_mlps(model, names)
    for name in found:
        module = model.get_submodule(name)
        set_forward_layer(module, _TAG, _tiled_forward, TiledLayer(module, chunks))
    return found


def remove_tiled_mlp(model: nn.Module) -> None:
    """Run every module of ``model`` as written again (see :func:`install_tiled_mlp`)."""
    for module in model.modules():
        set_forward_layer(module, _TAG, None)


def tiled_mlps(model: nn.Module) -> dict[str, int]:
    """Tiled modules of ``model`` and their chunk counts."""
    out = {}
    for name, module in model.named_modules():
        layer = forward_layers(module).get(_TAG)
        if layer is not None:
            out[name] = layer.state.chunks
    return out
