"""Frozen weights held smaller: the ``frozen_bf16`` and ``frozen_nf4`` levers.

A frozen weight (``requires_grad=False``: a LoRA model's base, or any model's frozen part)
has no gradient and no optimizer state, so it needs no fp32 master copy:

- ``frozen_bf16`` keeps every frozen floating parameter in bf16 (2 bytes instead of 4), in
  place (``p.data``), so the parameter objects stay the same; the step computes in bf16.
- ``frozen_nf4`` keeps the weights of frozen ``nn.Linear`` modules in NF4 as QLoRA defines
  it (4-bit NormalFloat codes, one scale per block of 64 values, the scales quantized to
  8 bits per block of 256), through torchao's ``NF4Tensor``: about 0.53 bytes per value.
  Embeddings, norms, biases and the model's output head stay as they are (or bf16 with
  ``frozen_bf16``): See Note [what NF4 replaces]. The forward dequantizes each weight to
  the input's dtype when it is called (recomputed under checkpointing like any op);
  gradients flow to the inputs and the adapters, never to the NF4 weight.

Trade-off: NF4 changes the base model's weights (a quantization error of a few percent per
weight), so ``memfit check --levers`` judges it, and the planner uses it only when the
budget needs it; each call dequantizes a whole weight (torchao's temporaries, about 14
bytes per value of the largest weight on a CPU, measured by
:func:`memfit.measuring.lever_facts.frozen_facts`).

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(128, 128).requires_grad_(False)
    >>> saved = quantize_frozen(torch.nn.Sequential(lin))
    >>> type(lin.weight).__name__, lin(torch.ones(2, 128)).shape
    ('NF4Tensor', torch.Size([2, 128]))
    >>> restore_frozen(saved); type(lin.weight.data).__name__
    'Tensor'
"""

from __future__ import annotations

import importlib.util
import typing
from dataclasses import dataclass, field

import torch
from torch import nn

from memfit.levers.head import find_head
from memfit.levers.quiet import import_torchao

__all__ = [
    "NF4_BLOCK",
    "NF4_SCALER_BLOCK",
    "FrozenSaved",
    "cast_frozen",
    "frozen_note",
    "frozen_params",
    "frozen_refusal",
    "is_nf4",
    "nf4_available",
    "nf4_linears",
    "park_frozen",
    "quantize_frozen",
    "restore_frozen",
    "to_nf4",
]

#: Values per NF4 block (one scale each), as QLoRA.
NF4_BLOCK = 64
#: Scales per block of the second quantization (8-bit scales), as QLoRA.
NF4_SCALER_BLOCK = 256
#: The one command that installs what frozen_nf4 needs.
_INSTALL = "pip install torchao"

# Note [what NF4 replaces]
# Only the weights of frozen nn.Linear modules become NF4 (QLoRA's choice: the matmul
# weights hold nearly all of a transformer's bytes). Embeddings are looked up, not
# multiplied, and norms and biases are small: they stay (bf16 with frozen_bf16). The model's
# output head (memfit.levers.head.find_head) stays too, as transformers' bitsandbytes
# loading keeps lm_head: its logits are where quantization error reaches the loss first,
# the chunked_loss lever multiplies by its weight directly, and dequantizing a
# vocabulary-sized weight makes the largest temporary of the step. A weight shared with
# another module (tied), or whose size 64 x 256 does not divide, stays as well.


def nf4_available() -> bool:
    """Whether torchao (its ``NF4Tensor``) can be imported."""
    try:
        return importlib.util.find_spec("torchao") is not None
    except (ImportError, ValueError, AttributeError):  # an import blocked in sys.modules
        return False


def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (2-D) as torchao's NF4Tensor, quantized from its bf16 values (QLoRA's blocks)."""
    import_torchao()  # quietly: See memfit.levers.quiet
    from torchao.quantization import to_nf4 as torchao_to_nf4

    return torchao_to_nf4(weight.detach().to(torch.bfloat16).contiguous(), NF4_BLOCK, NF4_SCALER_BLOCK)


def is_nf4(t: torch.Tensor) -> bool:
    """Whether ``t`` is an NF4 tensor (made by :func:`to_nf4`)."""
    return type(t).__name__ == "NF4Tensor"


def frozen_params(model: nn.Module) -> list[nn.Parameter]:
    """The floating parameters of ``model`` that do not train, each once (NF4 ones left out)."""
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if id(p) not in seen and p.is_floating_point() and not p.requires_grad and not is_nf4(p):
            seen.add(id(p))
            out.append(p)
    return out


def nf4_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The frozen ``nn.Linear`` modules whose weights ``frozen_nf4`` replaces (Note [what NF4 replaces])."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    spec = find_head(model)
    head = spec.head if spec is not None else None
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        w = module.weight
        if w.requires_grad or is_nf4(w) or not w.is_floating_point() or uses.get(id(w), 0) != 1:
            continue
        if w.dim() == 2 and w.numel() % (NF4_BLOCK * NF4_SCALER_BLOCK) == 0:
            out.append((name, module))
    return out


def frozen_refusal(lever: str, model: nn.Module | None) -> str | None:
    """Why ``lever`` (``frozen_bf16`` or ``frozen_nf4``) cannot run on ``model``, or None (a model
    of None is judged when the lever is applied); the precisions each runs at are the lever's
    (:mod:`memfit.applying.frozen`)."""
    if lever == "frozen_nf4" and not nf4_available():
        return (
            f"frozen_nf4 needs torchao's NF4 tensor, which is not installed: `{_INSTALL}` (or "
            "`pip install 'memfit[levers]'`) adds it; or leave frozen_nf4 out."
        )
    if model is None:
        return None
    if lever == "frozen_bf16" and not frozen_params(model):
        return (
            "frozen_bf16 keeps frozen weights in bf16, but every floating parameter of this model trains "
            "(none has requires_grad=False); freeze the base (e.g. LoRA) or leave frozen_bf16 out."
        )
    if lever == "frozen_nf4" and not nf4_linears(model) and not any(is_nf4(p) for p in model.parameters()):
        return (
            "frozen_nf4 quantizes the weights of frozen nn.Linear modules, and this model has none "
            "(requires_grad=False, a size that 64 x 256 divides, not the output head); freeze the base "
            "(e.g. LoRA) or leave frozen_nf4 out."
        )
    return None


@dataclass
class FrozenSaved:
    """What :func:`cast_frozen` and :func:`quantize_frozen` replaced, for :func:`restore_frozen`."""

    data: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)
    """(parameter, its storage before the cast)."""
    linears: list[tuple[nn.Linear, nn.Parameter, nn.Parameter]] = field(default_factory=list)
    """(module, its weight before, its NF4 weight)."""
    optimizer: torch.optim.Optimizer | None = None


def cast_frozen(model: nn.Module, saved: FrozenSaved | None = None) -> FrozenSaved:
    """Make every frozen floating parameter of ``model`` bf16 in place; returns what to restore."""
    saved = saved if saved is not None else FrozenSaved()
    for p in frozen_params(model):
        if p.dtype != torch.bfloat16:
            saved.data.append((p, p.data))
            p.data = p.data.to(torch.bfloat16)
    return saved


def _swap(optimizer: torch.optim.Optimizer | None, old: nn.Parameter, new: nn.Parameter) -> None:
    for group in optimizer.param_groups if optimizer is not None else []:
        group["params"] = [new if p is old else p for p in group["params"]]


def quantize_frozen(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, saved: FrozenSaved | None = None
) -> FrozenSaved:
    """Replace the weights of :func:`nf4_linears` by NF4 parameters; returns what to restore.

    An optimizer holding a replaced weight (frozen weights have no gradient, so it never
    steps them) holds the NF4 one instead, so the old weight's bytes are freed.
    """
    saved = saved if saved is not None else FrozenSaved()
    saved.optimizer = optimizer
    for _, module in nf4_linears(model):
        old = typing.cast(nn.Parameter, module.weight)
        new = nn.Parameter(to_nf4(old), requires_grad=False)
        module.weight = new
        _swap(optimizer, old, new)
        saved.linears.append((module, old, new))
    return saved


def park_frozen(saved: FrozenSaved) -> None:
    """Move the weights :func:`restore_frozen` will put back to host memory (from an
    accelerator), so that a measured step holds only the smaller ones."""
    saved.data = [(p, d.to("cpu") if d.device.type != "cpu" else d) for p, d in saved.data]
    for _, old, _ in saved.linears:
        if old.device.type != "cpu":
            old.data = old.data.to("cpu")


def frozen_note(levers: list[str], quantized: int = 0) -> str | None:
    """The plan's note on its frozen-weight levers (None without them); ``quantized``: the
    values NF4 holds.

    Example:
        >>> frozen_note(["frozen_bf16"]).split(" (")[0]
        'frozen_bf16: the frozen weights'
    """
    notes = []
    if "frozen_nf4" in levers:
        notes.append(
            f"frozen_nf4: the frozen nn.Linear weights ({quantized:,} values) in NF4 as QLoRA defines it "
            f"(blocks of {NF4_BLOCK}, their scales in 8 bits per {NF4_SCALER_BLOCK}), through torchao's "
            "NF4Tensor, not bitsandbytes even where installed: torchao's runs on CPUs and GPUs, is a tensor "
            "MemTracker counts and recomputes under checkpointing like any op; embeddings, norms, biases "
            "and the output head are not quantized (See Note [what NF4 replaces])"
        )
    if "frozen_bf16" in levers:
        rest = "the other frozen weights" if "frozen_nf4" in levers else "the frozen weights"
        notes.append(f"frozen_bf16: {rest} (requires_grad=False) in bf16, without an fp32 copy")
    return "; ".join(notes) + "." if notes else None


def restore_frozen(saved: FrozenSaved) -> None:
    """Put back what :func:`cast_frozen` / :func:`quantize_frozen` replaced (values as they were,
    on the device the model is on)."""
    for module, old, new in reversed(saved.linears):
        old.data = old.data.to(new.device)
        module.weight = old
        _swap(saved.optimizer, new, old)
    for p, data in saved.data:
        p.data = data.to(p.device)
    saved.linears, saved.data = [], []
