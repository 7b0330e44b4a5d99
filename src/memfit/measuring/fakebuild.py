"""Build a model under fake tensors where its constructor or its step needs real values.

:func:`memfit.estimate` builds the model, its optimizer and the batch under PyTorch's
``FakeTensorMode`` (shapes, dtypes and devices, no storage). Four things real training
does can fail there, and each has a fallback that keeps the bytes without allocating the
model:

- a constructor that reads the values it draws (``nn.init.trunc_normal_`` rejecting
  samples with ``if not mask.any()``, timm's ``torch.linspace(...).item()``): the model is
  built on the ``meta`` device (no values, and ``trunc_normal_`` skips meta tensors), then
  every parameter and buffer becomes a fake tensor of the same shape, stride and dtype
  (:func:`build_fake`); initial values do not change memory;
- a fake kernel narrower than the real one (``aten._grouped_mm``'s fake implementation
  accepts bf16/fp16 only, the CPU kernel takes fp32 as well): :class:`FakeFallbacks` makes
  the output from the kernel's shape rule;
- a forward that reads values: the batch keeps its real values (:func:`fake_batch`), so a
  check such as ``labels.max() >= vocab_size`` is answered from them, and a random scalar
  the forward branches on (LayerDrop's ``torch.rand([]) < p``) is read as just under 1, the
  step that drops nothing (see Note [random scalars read as just under one]);
- code that reads the positions a model makes from a length (Hugging Face's masking code,
  choosing between an explicit mask and SDPA's ``is_causal``): a small ``arange`` keeps its
  values, and that code reads them as a real step's (see Note [positions keep their values]).

Each fallback used is said once, in one line (:meth:`FakeFallbacks.lines`). A value that
only a real step has (an ``.item()`` on an activation) is the model's limit, not the
batch's fault: :func:`model_limits` says so in one sentence.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> class Drawn(nn.Linear):
    ...     def reset_parameters(self) -> None:
    ...         nn.init.trunc_normal_(self.weight, std=0.02)
    >>> mode = FakeTensorMode()
    >>> built = build_fake(mode, lambda: Drawn(4, 2))
    >>> built.model.weight.shape, built.how is not None
    (torch.Size([2, 4]), True)
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from memfit.errors import ConfigError, MemfitError, shown
from memfit.step import Batch

__all__ = ["FakeFallbacks", "FakeModel", "build_fake", "fake_batch", "model_limits", "values_known_untraced"]

_aten = torch.ops.aten
_LIFTS = (_aten.lift_fresh.default, _aten.lift_fresh_copy.default)
_RANDOM_SCALARS = (_aten.rand.default, _aten.rand.generator, _aten.rand_like.default)
#: Ops whose values follow from their arguments alone (positions made from a length).
_RANGES = (_aten.arange.default, _aten.arange.start, _aten.arange.start_step)


@dataclass
class FakeModel:
    """A model whose parameters and buffers are fake tensors, and how it was built."""

    model: nn.Module
    how: str | None = None
    """None when ``model_fn`` ran under fake tensors; else the one line saying the fallback."""


def _module(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model_fn returned {type(model).__name__}; it must return an nn.Module.")
    return model


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, DataDependentOutputException):
        return "a tensor's value is read: .item(), bool() or an `if` on a tensor"
    if isinstance(exc, DynamicOutputShapeException):
        return f"{exc.func}'s output shape depends on values"
    text = str(exc).strip()
    return shown(text.splitlines()[0], 80) if text else type(exc).__name__


def _materialize(mode: FakeTensorMode, model: nn.Module) -> None:
    """Every parameter and buffer that is not yet one of ``mode``'s fake tensors becomes one
    on the CPU, of the same shape, stride and dtype (tied parameters stay tied)."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, FakeTensor) and t.fake_mode is mode:
            return t
        if id(t) not in made:
            with mode:
                empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            made[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
        return made[id(t)]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = fake(p)  # type: ignore[assignment]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = fake(b)


def build_fake(mode: FakeTensorMode, model_fn: Callable[[], nn.Module]) -> FakeModel:
    """Build ``model_fn()`` under ``mode``; where its constructor needs real values, on the
    meta device, its parameters and buffers then made fake tensors of ``mode``.

    Trade-off: the meta build calls ``model_fn`` a second time and keeps no initial values
    (memory does not depend on them); a tensor the constructor keeps as a plain attribute
    (neither parameter nor buffer) stays on the meta device.

    Raises:
        ConfigError: ``model_fn`` does not return a module, or it fails both ways (the
            message quotes both failures).
    """
    try:
        with mode:
            return FakeModel(_module(model_fn()))
    except MemfitError:
        raise
    except Exception as first:  # any failure: the meta build below is the verdict
        under_fake = first
    try:
        with torch.device("meta"):
            model = _module(model_fn())
    except MemfitError:
        raise
    except Exception as second:
        if type(second) is type(under_fake) and str(second) == str(under_fake):
            raise under_fake from None  # the constructor's own error, whatever the tensors
        raise ConfigError(
            f"model_fn could not be built without allocating it: under fake tensors it failed with "
            f"{_first_line(under_fake)!r} and on the meta device with {_first_line(second)!r}; "
            "build the model for real and use memfit.profile or memfit.measure instead."
        ) from second
    _materialize(mode, model)
    return FakeModel(
        model,
        f"{type(model).__name__}'s constructor needs values fake tensors do not have "
        f"({_first_line(under_fake)}), so it was built on the meta device and its parameters "
        "and buffers made fake tensors of the same shapes and dtypes (initial values do not "
        "change memory).",
    )


# Note [values from the batch]
# The batch is real: the user passed it. Its fake copies keep a copy of its values as
# fake-tensor constants, so an op whose inputs are all constants runs for real on them
# (FakeFallbacks keeps results up to a few times the batch's bytes as constants too): a check
# such as `if labels.max() >= vocab_size` is answered. An op whose output shape depends on
# values (CTC's `labels.masked_select(labels >= 0)`, `_ctc_loss`'s target lengths) runs for
# real once, on the constants' values and, for floating inputs without values (activations),
# on zeros expanded from one element, to learn its output's shape; that output is then made
# a fake tensor and the real one freed. Memory is still counted on the fake tensors only.


def fake_batch(mode: FakeTensorMode, batch: Batch) -> Batch:
    """The batch as fake tensors of ``mode`` (views stay views) that keep a copy of their real
    values (fake-tensor constants): an op on the batch alone that yields a scalar is answered
    from them, and the user's tensors are never written."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        fake = mode.from_tensor(t)
        if fake.constant is None:
            fake.constant = t.detach().clone()
            mode.fake_tensor_converter.add_constant_storage_mapping(fake)
        return fake

    return tree_map_only(torch.Tensor, convert, batch)


def _grouped_mm_refused(args: tuple[Any, ...]) -> bool:
    """Whether the fake ``aten._grouped_mm`` refuses what the CPU kernel accepts (fp32)."""
    a, b = args[0], args[1]
    return (
        a.device.type == "cpu"
        and a.dtype not in (torch.bfloat16, torch.float16)
        and a.dtype == b.dtype
        and a.is_floating_point()
    )


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> list[int]:
    """The output shape of ``torch._grouped_mm(a, b, offs)`` (the fake kernel's own rule)."""
    if a.dim() == 2 and b.dim() == 2:
        groups = offs.size(0) if offs is not None else 1
        return [groups, a.size(0), b.size(1)]
    if a.dim() == 2:
        return [a.size(0), b.size(-1)]
    if b.dim() == 2:
        return [a.size(1), b.size(1)]
    return [a.size(0), a.size(1), b.size(-1)]


def _fakes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[FakeTensor]:
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, FakeTensor)]


def _shape_decidable(fakes: list[FakeTensor]) -> bool:
    """Whether the batch's values decide a dynamic-shape op's output shape: some input is a
    constant and every integer or boolean input (indices, lengths, masks) is one; floating
    inputs without values carry data, not shapes (CTC's log-probabilities)."""
    return any(t.constant is not None for t in fakes) and all(
        t.device.type == "cpu" and (t.constant is not None or t.is_floating_point()) for t in fakes
    )


def _first_origin(origins: set[str | None]) -> str:
    """Where values come from: a random draw, the batch, or data the model made (torch.tensor)."""
    return next((o for o in ("random", "batch") if o in origins), "data")


def _scalar_draw(out: torch.Tensor) -> bool:
    return out.numel() <= 1 and out.is_floating_point() and out.device.type == "cpu"


# Note [random scalars read as just under one]
# A forward that branches on a random scalar (LayerDrop: `if torch.rand([]) < layerdrop:
# skip the layer`) cannot run under fake tensors: the draw has no value. The step memory
# must fit is the one that drops nothing, so the draw is read as the largest float below
# 1: `draw < p` is then false for every p < 1 (no layer dropped) and true for p == 1, as
# in every real step. Only scalar draws become values; random tensors stay fake.


# Note [positions keep their values]
# A decoder makes its token positions from the sequence's length (`torch.arange(T)`) and
# Hugging Face's masking code reads them: `find_packed_sequence_indices` asks whether the
# positions restart (packed sequences), and only when they do not, and no padding is masked,
# does it hand SDPA no mask and `is_causal=True`. It does not read them where it finds a
# fake tensor (its `is_tracing` counts FakeTensor as tracing, as under torch.compile), and
# builds the explicit (batch, 1, T, T) mask instead, which the real step never holds: a
# fake step would predict T x T bytes (and SDPA's math path on a mask) that do not exist.
# So an `arange` small enough to compute keeps its values (a fake-tensor constant, as the
# batch's values are: See Note [values from the batch]); ops on constants keep theirs; and,
# while these fallbacks run, `transformers.masking_utils.is_tracing` answers for a tensor
# with known values what it answers for a real one (`values_known_untraced`). The masking
# code then reads the same values the real step reads and takes the same path; with values
# unknown (an activation), or under torch.compile, nothing changes. The name is swapped back
# on leaving: nothing a real step runs sees it.


def _untraced_check(original: Callable[..., bool]) -> Callable[..., bool]:
    """``is_tracing`` that looks past a fake tensor whose values are known."""

    def is_tracing(tensor: object = None) -> bool:
        known = isinstance(tensor, FakeTensor) and tensor.constant is not None
        return original(None if known else tensor)

    return is_tracing


@contextlib.contextmanager
def values_known_untraced() -> Iterator[None]:
    """While inside, Hugging Face's masking code reads a fake tensor with known values as it
    reads a real one (See Note [positions keep their values]); a no-op where transformers'
    masking code is not loaded.

    Example:
        >>> with values_known_untraced():
        ...     pass
    """
    module = sys.modules.get("transformers.masking_utils")
    original = getattr(module, "is_tracing", None)
    if module is None or not callable(original):
        yield
        return
    module.is_tracing = _untraced_check(original)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.is_tracing = original  # type: ignore[attr-defined]


class FakeFallbacks(TorchDispatchMode):
    """Answers, under a ``FakeTensorMode``, what its fake kernels refuse but a real step runs.

    Enter it inside ``with mode:``; it counts what it answered (:meth:`lines`).
    """

    def __init__(self, mode: FakeTensorMode, batch: Batch = ()) -> None:
        super().__init__()
        self.mode = mode
        self.counts: dict[str, int] = {"grouped_mm": 0, "random": 0, "batch": 0, "data": 0, "shape": 0}
        self._origin: dict[int, tuple[str, weakref.ref[torch.Tensor], torch.Tensor]] = {}
        """Constants from the batch, from random draws or made by the model with torch.tensor,
        and the constants computed from them: origin, the tensor, its value."""
        self._limit = 8 * sum(t.nbytes for t in tree_leaves(batch) if isinstance(t, torch.Tensor))
        """The most bytes one op on the batch's values alone may compute for real (a few copies
        of the batch, e.g. an int64 mask of fp32 audio)."""
        tree_map_only(torch.Tensor, lambda t: self._mark(t, "batch"), batch)
        self._untraced: list[contextlib.AbstractContextManager[None]] = []

    def _origin_of(self, t: object) -> str | None:
        got = self._origin.get(id(t))
        return got[0] if got is not None and got[1]() is t else None

    def _mark(self, t: torch.Tensor, origin: str) -> torch.Tensor:
        self._origin[id(t)] = (origin, weakref.ref(t), t.constant)  # type: ignore[attr-defined]
        return t

    def _settle(self, restore: bool) -> None:
        """Constants fake mode forgot: given back (``restore``: the op did not write them, or
        wrote them for real) or forgotten here too (the op wrote them with fake values)."""
        for key, (_, ref, value) in list(self._origin.items()):
            t = ref()
            if t is None or (t.constant is None and not restore):  # type: ignore[attr-defined]
                del self._origin[key]
            elif t.constant is None:  # type: ignore[attr-defined]
                self._constant(t, value)

    def _constant(self, t: torch.Tensor, value: torch.Tensor) -> None:
        t.constant = value  # type: ignore[attr-defined]
        self.mode.fake_tensor_converter.add_constant_storage_mapping(t)  # type: ignore[arg-type]

    @staticmethod
    def _real(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func`` run for real: constants give their values, other fake tensors zeros of their
        shape and dtype (expanded from one element: nothing allocated for them)."""

        def stand_in(t: FakeTensor) -> torch.Tensor:
            return t.constant if t.constant is not None else torch.zeros((), dtype=t.dtype).expand(t.shape)

        with unset_fake_temporarily():
            real_args, real_kwargs = tree_map_only(FakeTensor, stand_in, (args, kwargs))
            return func(*real_args, **real_kwargs)

    def _shaped(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], origin: str) -> Any:
        """A dynamic-shape op's outputs, shaped as the real op's (constants if every input was one)."""
        self.counts["shape"] += 1
        constant = all(t.constant is not None for t in _fakes(args, kwargs))
        convert = self.mode.fake_tensor_converter

        def fake(t: torch.Tensor) -> torch.Tensor:
            if constant:
                return self._mark(convert.from_real_tensor(self.mode, t, make_constant=True), origin)
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)

        return tree_map_only(torch.Tensor, fake, self._real(func, args, kwargs))

    def _on_values(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], origin: str) -> Any:
        """``func`` on tensors from the batch or a draw. See Note [values from the batch]."""
        if func is _aten._local_scalar_dense.default:
            self.counts[origin] += 1
        fakes = _fakes(args, kwargs)
        real_run = bool(fakes) and all(t.constant is not None for t in fakes)
        real_run = real_run and not {torch.Tag.nondeterministic_seeded, torch.Tag.inplace_view} & set(
            func.tags
        )
        out = func(*args, **kwargs)
        written = func._schema.is_mutable or torch.Tag.inplace_view in func.tags
        if any(t.constant is None for t in fakes if self._origin_of(t)):
            # Fake mode forgets the constants a result it cannot keep as one aliases, also
            # inside kernels (convolution's backend check); they are still right unless the
            # op wrote them with fake values.
            self._settle(restore=real_run or not written)
        if not real_run or written:
            return out
        if isinstance(out, FakeTensor) and out.constant is None and out.nbytes <= self._limit:
            real = self._real(func, args, kwargs)
            if isinstance(real, torch.Tensor) and real.shape == out.shape and real.dtype == out.dtype:
                self._constant(out, real)
        if isinstance(out, FakeTensor) and out.constant is not None:
            self._mark(out, origin)
        return out

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _aten._grouped_mm.default and _grouped_mm_refused(args):
            self.counts["grouped_mm"] += 1
            a, offs = args[0], args[2] if len(args) > 2 else kwargs.get("offs")
            dtype = kwargs.get("out_dtype") or (args[4] if len(args) > 4 else None) or a.dtype
            return torch.empty(_grouped_mm_shape(a, args[1], offs), dtype=dtype, device=a.device)
        if func in _LIFTS and type(args[0]) is torch.Tensor and args[0].nbytes <= self._limit:
            # torch.tensor(data): real values the model made (SpecAugment's mask from numpy)
            convert = self.mode.fake_tensor_converter
            return self._mark(convert.from_real_tensor(self.mode, args[0], make_constant=True), "data")
        leaves = tree_leaves((args, kwargs))
        origins = {self._origin_of(a) for a in leaves} - {None}
        if torch.Tag.dynamic_output_shape in func.tags:
            fakes = [t for t in leaves if isinstance(t, FakeTensor)]
            if _shape_decidable(fakes):  # a constant's values give the shape, whoever made it
                return self._shaped(func, args, kwargs, _first_origin(origins))
        if origins:
            return self._on_values(func, args, kwargs, _first_origin(origins))
        out = func(*args, **kwargs)
        if func in _RANGES and isinstance(out, FakeTensor) and out.nbytes <= self._limit:
            return self._range(func, args, kwargs, out)
        if func in _RANDOM_SCALARS and _scalar_draw(out):
            with unset_fake_temporarily():  # See Note [random scalars read as just under one]
                one = torch.ones(out.shape, dtype=out.dtype)
                value = torch.nextafter(one, torch.zeros_like(one))
            const = self.mode.fake_tensor_converter.from_real_tensor(self.mode, value, make_constant=True)
            return self._mark(const, "random")
        return out

    def _range(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: FakeTensor) -> Any:
        """An ``arange`` with its values kept (See Note [positions keep their values])."""
        try:
            real = self._real(func, args, kwargs)
        except (RuntimeError, AssertionError):  # a device this process has no kernels for
            return out
        const = self.mode.fake_tensor_converter.from_real_tensor(self.mode, real, make_constant=True)
        return self._mark(const, "data")

    def __enter__(self) -> FakeFallbacks:
        self._untraced.append(values_known_untraced())
        self._untraced[-1].__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._untraced.pop().__exit__(None, None, None)

    def lines(self) -> list[str]:
        """One line per fallback used."""
        out = []
        if self.counts["grouped_mm"]:
            out.append(
                "aten._grouped_mm's fake kernel accepts bf16/fp16 only while the CPU kernel also "
                "runs fp32, so its fp32 outputs were made from the kernel's shape rule "
                f"({self.counts['grouped_mm']} calls)."
            )
        if self.counts["batch"]:
            out.append(
                f"The step read values computed from the batch alone {self.counts['batch']} times "
                "(e.g. a check of the labels' range); the batch's real values answered them."
            )
        if self.counts["shape"]:
            out.append(
                f"Ops whose output shape depends on values (e.g. masked_select on the labels) ran "
                f"{self.counts['shape']} times for real on the values they had, which gave their shapes."
            )
        if self.counts["random"]:
            out.append(
                f"The step branched on random scalars {self.counts['random']} times (e.g. LayerDrop); "
                "each draw was read as just under 1, the step that drops nothing."
            )
        return out


_LIMITS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)


@contextlib.contextmanager
def model_limits(model: nn.Module) -> Iterator[None]:
    """Turn a failure that is fake tensors' limit on the model's step (a value only a real
    step has, an output shape that depends on values, an op without a fake kernel) into one
    :class:`ConfigError` that names the model, not the batch."""
    try:
        yield
    except _LIMITS as exc:
        what = (
            "needs a value that only a real step has"
            if isinstance(exc, DataDependentOutputException | DynamicOutputShapeException)
            else "runs an op that has no fake-tensor kernel"
        )
        raise ConfigError(
            f"memfit.estimate cannot run {type(model).__name__}'s training step under fake "
            f"tensors: it {what} ({_first_line(exc)}), which is the model's limit, not the batch's fault; "
            "measure it for real with memfit.profile or memfit.measure."
        ) from exc
