"""Which levers a plan may use, and the one sentence saying why one cannot be used here.

``levers=None`` (the default everywhere) uses none: each lever changes the numerics
(``state_*``, ``weights_bf16``) or the step's structure (``fused_step``, ``offload``,
``chunked_loss``: the model's output has no logits), so it is used only when asked.
``"all"`` allows every lever this device, optimizer, precision and model can run (the
frozen-weight levers only on a model with frozen weights); a list names them. At most one
``state_*`` lever applies at a time.

Example:
    >>> normalize_levers("fused_step,state_8bit")
    ['fused_step', 'state_8bit']
    >>> state_kind(["fused_step", "state_4bit"])
    '4bit'
    >>> refusal("offload", device="cpu", optimizer_name="AdamW", precision="fp32")[:40]
    'offload moves activations to host memory'
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from memfit.errors import ConfigError, LeverRefused
from memfit.levers.frozen import frozen_refusal
from memfit.levers.head import head_refusal
from memfit.vocab import LEVERS

__all__ = [
    "ADAM_LIKE",
    "STATE_LEVERS",
    "allowed_levers",
    "check_levers",
    "missing_torchao_hint",
    "normalize_levers",
    "refusal",
    "state_kind",
    "torchao_available",
]

#: State lever -> the dtype its optimizer keeps Adam's two moments in.
STATE_LEVERS: dict[str, str] = {"state_bf16": "bf16", "state_8bit": "8bit", "state_4bit": "4bit"}
#: Optimizers whose state levers and bf16 weights can be carried over (same hyper-parameters).
ADAM_LIKE = ("Adam", "AdamW")
#: Levers that need torchao's optimizers.
_TORCHAO = (*STATE_LEVERS, "weights_bf16")
#: The one command that installs what the torchao levers need.
_TORCHAO_INSTALL = "pip install 'memfit[levers]'"


def torchao_available() -> bool:
    """Whether torchao (the low-precision AdamW optimizers) can be imported."""
    try:
        return importlib.util.find_spec("torchao") is not None
    except (ImportError, ValueError, AttributeError):  # an import blocked in sys.modules
        return False


def missing_torchao_hint(levers: str | Iterable[str] | None) -> str | None:
    """What of ``levers`` is left out for want of torchao, and the command that adds it; None if nothing.

    For a command's output where ``levers="all"`` quietly plans without the state levers.

    Example:
        >>> hint = missing_torchao_hint("fused_step")
        >>> hint is None
        True
    """
    missing = [n for n in normalize_levers(levers) if n in _TORCHAO]
    if not missing or torchao_available():
        return None
    names = ", ".join(missing[:-1]) + (" and " if len(missing) > 1 else "") + missing[-1]
    return (
        f"{names} {'were' if len(missing) > 1 else 'was'} left out: "
        f"{'they need' if len(missing) > 1 else 'it needs'} torchao's low-precision AdamW, which is not "
        f"installed; `{_TORCHAO_INSTALL}` adds it"
    )


def normalize_levers(levers: str | Iterable[str] | None) -> list[str]:
    """Lever names in :data:`memfit.vocab.LEVERS` order from None, ``"all"``, ``"a,b"`` or a list.

    Raises:
        ConfigError: an unknown lever name.
    """
    if levers is None:
        return []
    if isinstance(levers, str):
        if levers.strip() in ("all", ""):
            return list(LEVERS) if levers.strip() == "all" else []
        names = [n.strip() for n in levers.split(",") if n.strip()]
    else:
        names = [str(n).strip() for n in levers]
    unknown = [n for n in names if n not in LEVERS]
    if unknown:
        raise ConfigError(f"unknown lever {unknown[0]!r}; the levers are {', '.join(LEVERS)} (or 'all').")
    return [n for n in LEVERS if n in names]


def state_kind(levers: Sequence[str]) -> str:
    """The optimizer state's kind a lever set asks for: ``fp32`` (unchanged), ``bf16``, ``8bit``, ``4bit``.

    Raises:
        ConfigError: two state levers at once.
    """
    kinds = [STATE_LEVERS[n] for n in levers if n in STATE_LEVERS]
    if len(kinds) > 1:
        raise ConfigError(
            f"levers {[n for n in levers if n in STATE_LEVERS]} each set the optimizer state's "
            "precision; keep one."
        )
    return kinds[0] if kinds else "fp32"


def refusal(
    lever: str,
    *,
    device: str | torch.device,
    optimizer_name: str,
    precision: str,
    model: nn.Module | None = None,
) -> str | None:
    """Why ``lever`` cannot run here (one sentence), or None when it can (``chunked_loss``,
    ``frozen_bf16`` and ``frozen_nf4`` are judged on ``model``; without one, when applied)."""
    dev = torch.device(device)
    if lever == "chunked_loss":
        return None if model is None else head_refusal(model)
    if lever in ("frozen_bf16", "frozen_nf4"):
        return frozen_refusal(lever, model, precision)
    if lever == "offload" and dev.type != "cuda":
        return (
            "offload moves activations to host memory, which on a CPU is the memory they are in: it "
            "saves nothing there, so it runs on CUDA only."
        )
    if lever in _TORCHAO and not torchao_available():
        return (
            f"{lever} needs torchao's low-precision AdamW: `pip install torchao` (or "
            f"`pip install 'memfit[levers]'`), or leave {lever} out."
        )
    if lever in _TORCHAO and optimizer_name not in ADAM_LIKE:
        return (
            f"{lever} carries the optimizer over to torchao's AdamW with the same hyper-parameters, which "
            f"needs torch.optim.Adam or AdamW; the optimizer is {optimizer_name}."
        )
    if lever == "fused_step" and optimizer_name == "none":
        return "fused_step steps the optimizer inside the backward; pass the optimizer training uses."
    if lever == "fused_step" and precision == "fp16":
        return (
            "fused_step steps each parameter inside the backward, before fp16 loss scaling could check "
            "every gradient for overflow; use bf16 (no loss scaling) or leave fused_step out."
        )
    if lever == "weights_bf16" and precision not in ("bf16", "auto"):
        return (
            f"weights_bf16 keeps the weights in bf16, so the step computes in bf16; it cannot run at "
            f"precision {precision}: use bf16."
        )
    return None


def _name(optimizer: torch.optim.Optimizer | None) -> str:
    if optimizer is None:
        return "none"
    # An optimizer already carried over by memfit (torchao's) still counts as Adam-like.
    return getattr(optimizer, "memfit_family", type(optimizer).__name__)


def allowed_levers(
    levers: str | Iterable[str] | None,
    *,
    device: str | torch.device,
    optimizer: torch.optim.Optimizer | None,
    precision: str,
    model: nn.Module | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The levers asked for that can run here, and ``{lever: why not}`` for the rest."""
    kept, refused = [], {}
    for lever in normalize_levers(levers):
        why = refusal(lever, device=device, optimizer_name=_name(optimizer), precision=precision, model=model)
        if why is None:
            kept.append(lever)
        else:
            refused[lever] = why
    return kept, refused


def check_levers(
    levers: Sequence[str],
    *,
    device: str | torch.device,
    optimizer: torch.optim.Optimizer | None,
    precision: str,
    model: nn.Module | None = None,
) -> None:
    """Refuse a lever set that cannot run here.

    Raises:
        LeverRefused: the first lever that cannot run, with the reason.
        ConfigError: an unknown lever, or two state levers.
    """
    names = normalize_levers(levers)
    state_kind(names)
    _, refused = allowed_levers(names, device=device, optimizer=optimizer, precision=precision, model=model)
    for lever, why in refused.items():
        raise LeverRefused(why, lever)
