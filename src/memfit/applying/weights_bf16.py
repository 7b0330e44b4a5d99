"""The ``weights_bf16`` lever: bf16 weights without an fp32 master copy, their updates rounded
stochastically by torchao's AdamW (:mod:`memfit.levers.weights`, :mod:`memfit.levers.optim`).

The step computes in bf16, so it runs at precision bf16 only. Its bytes are exact from a
profile measured with bf16 weights; from an fp32 profile (an estimate) parameters and
gradients are halved and autocast's cached weight casts taken out (bf16 weights make none);
what autograd saves (mode ``none``: the casts too) moves by the difference measured in one
forward with bf16 weights (:attr:`memfit.records.LeverFacts.weights_saved_delta`; See Note
[the weights measured in bf16] in :mod:`memfit.measuring.lever_facts`), else is kept, an
upper bound.

Example:
    >>> WEIGHTS_BF16.runs_at("bf16"), WEIGHTS_BF16.runs_at("fp32")
    (True, False)
"""

from __future__ import annotations

import torch

from memfit.applying.lever import Applying, Lever, Predicting, Site
from memfit.applying.state import carry_over, predict_torchao_state, torchao_refusal
from memfit.errors import ConfigError
from memfit.levers.weights import cast_weights, restore_weights
from memfit.precision import PRECISION_KINDS
from memfit.records import BlockStats, LeverFacts, Profile

__all__ = ["WEIGHTS_BF16", "WeightsBf16Lever"]

_BF16 = "bf16"


class WeightsBf16Lever(Lever):
    """bf16 weights, no fp32 copy."""

    name = "weights_bf16"
    risk = 7
    excludes = ("frozen_bf16",)  # bf16 weights are bf16 frozen weights too
    order = 10
    optimizer_kind = "fp32"
    bf16_weights = True
    needs_optimizer = True

    def refusal(self, site: Site) -> str | None:
        why = torchao_refusal(self.name, site)
        if why is None and site.precision != "auto" and not self.runs_at(site.precision):
            return (
                f"weights_bf16 keeps the weights in bf16, so the step computes in bf16; it cannot run at "
                f"precision {site.precision}: use bf16."
            )
        return why

    def runs_at(self, precision: str) -> bool:
        kind = PRECISION_KINDS.get(precision)  # the weights are bf16: the step computes in bf16
        return kind is not None and kind.dtype == torch.bfloat16

    def predict(self, out: Profile, ctx: Predicting) -> None:
        if not self.runs_at(ctx.base.precision):
            raise ConfigError(f"weights_bf16 computes in bf16; this profile is at {ctx.base.precision}.")
        if ctx.base.weights != _BF16:
            _bf16_weights(out, ctx.base, ctx.facts, ctx.weight_bytes)
        if ctx.optimizer_lever == self.name:
            predict_torchao_state(out, ctx)

    def apply(self, optimizer: torch.optim.Optimizer | None, ctx: Applying) -> torch.optim.Optimizer | None:
        assert optimizer is not None  # needs_optimizer: refused before
        saved = cast_weights(ctx.model)
        if ctx.undo is not None:
            ctx.undo.add(lambda: restore_weights(saved))
        if ctx.optimizer_lever == self.name:
            return carry_over(optimizer, self.optimizer_kind or "", weights_bf16=True)
        return optimizer


WEIGHTS_BF16 = WeightsBf16Lever()


def _bf16_weights(out: Profile, profile: Profile, facts: LeverFacts, wbytes: int) -> None:
    """``out`` with the fp32 weights of ``profile`` in bf16 (in place)."""
    half = facts.weight_bytes // wbytes
    trained = sum(n for ns in facts.params.values() for n in ns)
    out.param_bytes = (trained + facts.frozen_numel) * wbytes + facts.other_bytes
    out.grad_bytes = profile.grad_bytes // half
    out.early_grad_bytes = profile.early_grad_bytes // half
    delta = facts.weights_saved_delta
    for b in out.blocks:
        b.grad_bytes //= half
        b.param_bytes = sum(facts.params.get(b.name, [])) * wbytes
        for mode, value in b.backward_peak_bytes.items():
            b.backward_peak_bytes[mode] = value - _grad(profile, b.name) + b.grad_bytes
        _without_casts(b)
        _saved_moved(b, delta.get(b.name, 0))
        # a full block's recompute makes the casts mode none saves again: none with bf16 weights
        if "full" in b.backward_peak_bytes:
            recast = max(0, -delta.get(b.name, 0))
            b.backward_peak_bytes["full"] = max(b.grad_bytes, b.backward_peak_bytes["full"] - recast)
    _saved_moved(out.outside, delta.get("", 0))
    out.activation_bytes = max(0, out.activation_bytes + sum(delta.values()))
    out.weights = _BF16
    what = "what autograd saves measured with bf16 weights" if delta else "other activations as measured"
    out.notes = [
        *out.notes,
        "weights_bf16 predicted from a profile with fp32 weights: parameters and gradients halved, "
        f"autocast's cached weight casts out (bf16 weights are not cast), {what}.",
    ]


def _grad(profile: Profile, name: str) -> int:
    """A block's gradient bytes in ``profile`` (0 for a name it does not have)."""
    return next((b.grad_bytes for b in profile.blocks if b.name == name), 0)


def _saved_moved(part: BlockStats, delta: int) -> None:
    """``part``'s mode ``none`` saving ``delta`` more bytes, in place."""
    if not delta or "none" not in part.saved_bytes:
        return
    part.saved_bytes["none"] = max(0, part.saved_bytes["none"] + delta)
    if "none" in part.held_bytes:
        part.held_bytes["none"] = max(0, part.held_bytes["none"] + delta)
    if "none" in part.forward_peak_bytes:
        part.forward_peak_bytes["none"] = max(0, part.forward_peak_bytes["none"] + delta)


def _without_casts(block: BlockStats) -> None:
    """``block`` without autocast's cached bf16 casts of its fp32 weights (in place): what it
    holds to the forward's end beyond what it saves (Note [held and saved bytes] in
    :mod:`memfit.stepmodel.memory`), made in its forward, so out of its forward peak too."""
    for mode, held in block.held_bytes.items():
        saved = block.own_saved_bytes(mode) if mode in block.saved_bytes else held
        cache = max(0, held - saved)
        block.held_bytes[mode] = held - cache
        if mode in block.forward_peak_bytes:
            block.forward_peak_bytes[mode] = max(saved, block.forward_peak_bytes[mode] - cache)
