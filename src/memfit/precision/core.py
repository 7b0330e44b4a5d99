"""Mixed precision for one device: :class:`Precision`, the autocast context and the loss scaler.

Trade-off: bf16 and fp16 halve the bytes of most activations and run faster where the
hardware computes in them natively; fp16 needs dynamic loss scaling because its range is
small (largest value 65504), and some modules (losses, norms over long sums) are better
kept in fp32 via ``fp32_modules``.

The fp32 path uses the same code: ``autocast()`` is a ``nullcontext`` and the scaler is a
disabled ``GradScaler`` whose ``scale``/``step``/``update`` pass straight through. What each
precision does is its :class:`~memfit.precision.kind.PrecisionKind` (:mod:`memfit.precision.registry`).

Example:
    >>> p = Precision("fp32", device="cpu")
    >>> p.mode, p.scaler.is_enabled()
    ('fp32', False)
    >>> Precision("fp16", device="cpu").scaler.is_enabled()
    True
"""

from __future__ import annotations

import contextlib
import difflib
import typing
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from memfit.checkpointing.layers import set_forward_layer
from memfit.devices import device_facts, recommend_precision
from memfit.errors import ConfigError, UnsupportedPrecision
from memfit.precision.kind import PrecisionKind
from memfit.precision.registry import PRECISION_KINDS, precision_kind
from memfit.vocab import PrecisionChoice, PrecisionName, normalize_precision

__all__ = ["DTYPES", "Precision", "as_precision"]

#: Each precision's autocast dtype (fp32: none), by name.
DTYPES: dict[str, torch.dtype] = {name: kind.dtype for name, kind in PRECISION_KINDS.items()}
_TAG = "fp32"


def _to_fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float32:
        return x.float()
    return x


def _fp32_forward(inner: Callable[..., Any], device_type: str, *args: Any, **kwargs: Any) -> Any:
    with torch.autocast(device_type, enabled=False):
        return inner(*tree_map(_to_fp32, args), **tree_map(_to_fp32, kwargs))


class Precision:
    """The precision a model trains in: autocast context, loss scaler, fp32-kept modules.

    Args:
        mode: ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"auto"`` (bf16 where the device
            computes it natively, fp16 on GPUs without bf16, else fp32; ``.reason`` says
            which fact decided).
        device: the device the model trains on (default: CUDA if present, else CPU).
        fp32_modules: qualified module names or module classes that run with autocast
            off and their floating inputs cast to fp32; installed by :meth:`attach`.

    Raises:
        UnsupportedPrecision: an unknown mode, or bf16/fp16 where the device cannot run it.
    """

    def __init__(
        self,
        mode: PrecisionChoice = "auto",
        device: str | torch.device | None = None,
        fp32_modules: Iterable[str | type[nn.Module]] = (),
    ) -> None:
        facts = device_facts(device)
        self.device = torch.device(facts.name)
        self.facts = facts
        try:
            choice = normalize_precision(mode, allow_auto=True)
        except ConfigError as exc:
            raise UnsupportedPrecision(str(exc)) from None
        kind = precision_kind(recommend_precision(facts) if choice == "auto" else choice)
        self.reason = (
            kind.chosen_because.format(device=facts.description) if choice == "auto" else "asked for"
        )
        why = kind.refusal(facts)
        if why is not None:
            raise UnsupportedPrecision(why)
        self.kind: PrecisionKind = kind
        """What this precision is (:mod:`memfit.precision.registry`)."""
        self.mode: PrecisionName = normalize_precision(kind.name)
        self.dtype: torch.dtype = kind.dtype
        self.fp32_modules: tuple[str | type[nn.Module], ...] = tuple(fp32_modules)
        self.scaler = kind.scaler(self.device.type)

    def __repr__(self) -> str:
        return f"Precision(mode={self.mode!r}, device={str(self.device)!r}, reason={self.reason!r})"

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context the forward pass runs in (``nullcontext`` for fp32)."""
        return self.kind.autocast(self.device.type)

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """The backward of ``loss``, scaled when the precision scales it; returns the scaled loss."""
        return self.kind.backward(loss, self.scaler)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step ``optimizer`` through the scaler; returns whether the step was skipped (fp16: an
        overflow lowers the scale instead)."""
        return self.kind.optimizer_step(optimizer, self.scaler)

    def attach(self, model: nn.Module) -> nn.Module:
        """Make ``fp32_modules`` of ``model`` run in fp32 under autocast; returns ``model``.

        Raises:
            ConfigError: a name in ``fp32_modules`` is not a module of ``model``.
        """
        named = dict(model.named_modules())
        targets: list[nn.Module] = []
        for spec in self.fp32_modules:
            if isinstance(spec, str):
                if spec not in named:
                    close = difflib.get_close_matches(spec, list(named), n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    raise ConfigError(
                        f"fp32_modules names {spec!r}, which is not a module of {type(model).__name__}{hint}."
                    )
                targets.append(named[spec])
            else:
                targets += [m for m in model.modules() if isinstance(m, spec)]
        for module in targets:
            set_forward_layer(module, _TAG, _fp32_forward, self.device.type)
        return model

    @staticmethod
    def detach(model: nn.Module) -> nn.Module:
        """Remove what :meth:`attach` installed."""
        for module in model.modules():
            set_forward_layer(module, _TAG, None)
        return model

    def state_dict(self) -> dict[str, Any]:
        """The mode and the loss scaler's state, for training-state files."""
        return {"mode": self.mode, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the mode must match)."""
        if state.get("mode") != self.mode:
            raise ConfigError(
                f"saved training state used precision {state.get('mode')!r} but this run uses "
                f"{self.mode!r}; set precision to {state.get('mode')!r} to resume."
            )
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def as_precision(precision: str | Precision, device: str | torch.device | None = None) -> Precision:
    """Accept a mode name (checked: an unknown one is refused) or a :class:`Precision` (returned as is)."""
    if isinstance(precision, Precision):
        return precision
    return Precision(typing.cast(PrecisionChoice, precision), device=device)
