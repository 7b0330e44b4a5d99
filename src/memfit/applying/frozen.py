"""The frozen-weight levers: ``frozen_bf16`` (the frozen weights in bf16) and ``frozen_nf4``
(frozen ``nn.Linear`` weights in QLoRA's NF4 through torchao), :mod:`memfit.levers.frozen`.

They act together when both are in a set (the NF4 weights made first, the rest cast to
bf16), so their bytes are predicted once for the pair. The frozen weights' bytes come from
their counts and NF4's measured bytes; what autograd saves moves by the measured difference
(mode ``none``; the checkpointed modes keep theirs, an upper bound); every part's forward
and backward peaks grow by its largest NF4 weight's measured dequantization temporaries
(:class:`memfit.records.lever_facts.FrozenFacts`; See Note [the frozen weights measured] in
:mod:`memfit.measuring.lever_facts`). See Note [NF4 last] for their place in the order.

Example:
    >>> FROZEN_BF16.runs_at("bf16"), FROZEN_NF4.runs_at("fp16")
    (True, False)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from memfit.applying.lever import Applying, Lever, Predict, Predicting, Site
from memfit.errors import ConfigError
from memfit.levers.frozen import (
    FrozenSaved,
    cast_frozen,
    frozen_note,
    frozen_refusal,
    park_frozen,
    quantize_frozen,
    restore_frozen,
)
from memfit.precision import PRECISION_KINDS
from memfit.records import LeverFacts, Plan, Profile

__all__ = ["FROZEN_BF16", "FROZEN_NF4", "FrozenLever"]

# Note [NF4 last]
# A frozen base in bf16 rounds weights that never train (and holds nothing else): it comes
# right after no lever, before the optimizer state's levers and bf16 weights (which round
# the trained weights too). In NF4 the base moves by a quantization error of a few percent:
# the most a lever changes, so frozen_nf4 comes after every set without it, and the planner
# quantizes the base only when nothing else fits the budget.

_BF16, _NF4 = "frozen_bf16", "frozen_nf4"


class FrozenLever(Lever):
    """The frozen weights in bf16, or their Linear weights in NF4."""

    step_facts = True

    def __init__(self, name: str, risk: int, order: int, precision_refusal: str) -> None:
        self.name, self.risk, self.order = name, risk, order
        self._precision_refusal = precision_refusal
        """Why it cannot run at a precision :meth:`runs_at` refuses (``{precision}`` filled in)."""

    def refusal(self, site: Site) -> str | None:
        if site.precision != "auto" and not self.runs_at(site.precision):
            return self._precision_refusal.format(precision=site.precision)
        return frozen_refusal(self.name, site.model)

    def unpredictable(self, facts: LeverFacts | None) -> str | None:
        frozen = facts.frozen if facts is not None else None
        if frozen is None:
            return "the model has no frozen weights (requires_grad=False)"
        if self.name == _NF4 and not frozen.nf4:
            return "the model has no frozen nn.Linear weight NF4 can hold"
        return None

    def runs_at(self, precision: str) -> bool:
        # frozen_bf16 computes in bf16; NF4's bf16-scaled weights do not run under fp16 autocast
        kind = PRECISION_KINDS.get(precision)
        if self.name == _BF16:
            return kind is not None and kind.dtype == torch.bfloat16
        return kind is None or kind.dtype != torch.float16

    def _owns_pair(self, levers: Sequence[str]) -> bool:
        """Whether this lever predicts and notes the pair: NF4 when it is there, else bf16."""
        return self.name == _NF4 or _NF4 not in levers

    def predict(self, out: Profile, ctx: Predicting) -> None:
        if self._owns_pair(ctx.levers):
            _frozen(out, ctx.facts, ctx.levers, ctx.bf16_weights)

    def note(self, plan: Plan, profile: Profile, with_levers: Predict) -> str | None:
        if not self._owns_pair(plan.levers):
            return None
        frozen = profile.lever_facts.frozen if profile.lever_facts is not None else None
        return frozen_note(plan.levers, sum(map(sum, frozen.nf4.values())) if frozen is not None else 0)

    def apply(self, optimizer: torch.optim.Optimizer | None, ctx: Applying) -> torch.optim.Optimizer | None:
        if self.name == _NF4:
            saved = quantize_frozen(ctx.model, optimizer, FrozenSaved())
        else:
            saved = cast_frozen(ctx.model, FrozenSaved())
        if ctx.undo is not None:
            park_frozen(saved)  # the measured step holds only the smaller weights
            ctx.undo.add(lambda: restore_frozen(saved))
        return optimizer


FROZEN_BF16 = FrozenLever(
    _BF16, risk=1, order=61,
    precision_refusal="frozen_bf16 keeps the frozen weights in bf16, so the step computes in bf16; it cannot "
    "run at precision {precision}: use bf16.",
)  # fmt: skip
FROZEN_NF4 = FrozenLever(
    _NF4, risk=20, order=60,
    precision_refusal="frozen_nf4 dequantizes its bf16-scaled weights inside the step, which torch's fp16 "
    "autocast cannot run; use bf16 or fp32.",
)  # fmt: skip


def _frozen(out: Profile, facts: LeverFacts, names: Sequence[str], bf16_weights: bool) -> None:
    """``out`` with the frozen weights in bf16 and/or NF4 (in place)."""
    fz = facts.frozen
    if fz is None:
        raise ConfigError(
            "frozen_bf16 and frozen_nf4 cannot be predicted: this profile has no frozen-weight facts "
            "(the model has no frozen weights, or they were not measured); plan with the lever again."
        )
    nf4 = _NF4 in names
    if nf4 and not fz.nf4:
        raise ConfigError(
            "frozen_nf4 cannot be predicted: this model has no frozen Linear weight to quantize."
        )
    per = 2.0 if bf16_weights else fz.held_bytes / max(1, fz.numel)
    quantized = sum(n for ns in fz.nf4.values() for n in ns) if nf4 else 0
    after = 2.0 if _BF16 in names else per
    out.param_bytes += round((fz.numel - quantized) * (after - per) - quantized * per) + (
        fz.nf4_bytes if nf4 else 0
    )
    delta = fz.saved_delta.get(",".join(n for n in (_BF16, _NF4) if n in names), {})
    parts = {b.name: b for b in out.blocks}
    for name, d in delta.items():
        part = parts.get(name, out.outside) if name else out.outside
        if "none" in part.saved_bytes:
            part.saved_bytes["none"] = max(0, part.saved_bytes["none"] + d)
            if part is not out.outside:
                part.held_bytes["none"] = max(0, part.held_bytes.get("none", 0) + d)
                peak = part.forward_peak_bytes.get("none", 0) + d
                part.forward_peak_bytes["none"] = max(part.held_bytes["none"], peak)
    out.activation_bytes = max(0, out.activation_bytes + sum(delta.values()))
    for name, ns in fz.nf4.items() if nf4 else []:
        part = parts.get(name, out.outside) if name else out.outside
        fwd, bwd = (
            round(max(ns) * fz.nf4_forward_temp_per_element),
            round(max(ns) * fz.nf4_backward_temp_per_element),
        )
        part.forward_peak_bytes = {m: v + fwd for m, v in part.forward_peak_bytes.items()}
        part.backward_peak_bytes = {m: v + bwd for m, v in part.backward_peak_bytes.items()}
    what = "frozen weights in bf16" if _BF16 in names else ""
    if nf4:
        what = f"frozen Linear weights in NF4 ({quantized:,} values){', the rest ' + what if what else ''}"
    out.notes = [*out.notes, f"{what}; embeddings, norms and the output head are not quantized."]
