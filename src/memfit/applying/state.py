"""The optimizer-state levers: ``state_bf16``, ``state_8bit``, ``state_4bit`` (Adam's two
moments in bf16, or block-wise quantized by torchao: 4, about 2 or about 1 byte per
parameter instead of 8), one :class:`StateLever` each; at most one in a set.

The three kinds are this module's table, the only one: each lever's ``optimizer_kind``.
They carry the user's Adam or AdamW over to torchao's AdamW (:mod:`memfit.levers.optim`,
same param groups and hyper-parameters); ``weights_bf16`` carries it over too, with fp32
moments, when no state lever is in its set (:func:`carry_over`).

Example:
    >>> [lever.name for lever in STATE_LEVERS], STATE_8BIT.optimizer_kind
    (['state_bf16', 'state_8bit', 'state_4bit'], '8bit')
"""

from __future__ import annotations

import torch

from memfit.applying.lever import Applying, Lever, Predicting, Site
from memfit.levers.needs import ADAM_LIKE, TORCHAO_INSTALL, torchao_available
from memfit.levers.optim import is_lever_optimizer, lever_optimizer
from memfit.records import Profile
from memfit.stepmodel.state_bytes import state_bytes, step_slice_numel, temp_key

__all__ = [
    "STATE_4BIT",
    "STATE_8BIT",
    "STATE_BF16",
    "STATE_LEVERS",
    "StateLever",
    "carry_over",
    "predict_torchao_state",
    "torchao_refusal",
]


def torchao_refusal(lever: str, site: Site) -> str | None:
    """Why a lever that carries the optimizer over to torchao's AdamW cannot run at ``site``."""
    if not torchao_available():
        return (
            f"{lever} needs torchao's low-precision AdamW: `pip install torchao` (or "
            f"`{TORCHAO_INSTALL}`), or leave {lever} out."
        )
    if site.optimizer not in ADAM_LIKE:
        return (
            f"{lever} carries the optimizer over to torchao's AdamW with the same hyper-parameters, which "
            f"needs torch.optim.Adam or AdamW; the optimizer is {site.optimizer}."
        )
    return None


def predict_torchao_state(out: Profile, ctx: Predicting) -> None:
    """``out`` with torchao's AdamW of ``ctx.optimizer_kind`` instead of the user's optimizer:
    its exact state bytes, its step's temporaries for the slice it steps at once (See Note
    [pricing the step that runs] in memfit.stepmodel.state_bytes) and its step's time."""
    facts, kind, weights = ctx.facts, ctx.optimizer_kind, ctx.weights
    numels = [n for ns in facts.params.values() for n in ns]
    out.optimizer_bytes = sum(state_bytes(n, ctx.weight_bytes, kind, facts.amsgrad) for n in numels)
    out.optimizer = f"torchao AdamW ({kind} state)"
    per = facts.step_temp_per_element.get(temp_key(kind, weights), 0.0)
    sliced = (step_slice_numel(n, kind, facts.step_eager) for n in numels)
    out.optimizer_temp_bytes = round(per * max(sliced, default=0))
    out.optimizer_bytes_by_dtype = {}
    # the step's time: every trained element at the kind's measured cost instead of the
    # user's optimizer's (both measured eagerly: an upper bound;
    # see Note [compiled code runs eagerly when tracked] in memfit.measuring.tracker)
    sec = facts.step_seconds_per_element
    new, old = sec.get(temp_key(kind, weights)), sec.get(temp_key("orig", ctx.base.weights))
    if new is not None and old is not None and ctx.base.step_seconds > 0:
        out.step_seconds = max(0.0, ctx.base.step_seconds + (new - old) * sum(numels))


def carry_over(optimizer: torch.optim.Optimizer, kind: str, weights_bf16: bool) -> torch.optim.Optimizer:
    """torchao's AdamW of ``kind`` over ``optimizer``'s parameters (``optimizer`` itself when it
    is one already, of that kind and rounding: a plan applied again keeps its state)."""
    same = is_lever_optimizer(optimizer) and getattr(optimizer, "memfit_state", "") == kind
    if same and getattr(optimizer, "bf16_stochastic_round", False) == weights_bf16:
        return optimizer
    return lever_optimizer(optimizer, kind, weights_bf16=weights_bf16)


class StateLever(Lever):
    """Adam's moments in a smaller kind (torchao's AdamW)."""

    group = "state"
    order = 20
    needs_optimizer = True

    def __init__(self, kind: str, risk: int) -> None:
        self.name = f"state_{kind}"
        self.optimizer_kind = kind
        self.risk = risk

    def refusal(self, site: Site) -> str | None:
        return torchao_refusal(self.name, site)

    def predict(self, out: Profile, ctx: Predicting) -> None:
        predict_torchao_state(out, ctx)

    def apply(self, optimizer: torch.optim.Optimizer | None, ctx: Applying) -> torch.optim.Optimizer | None:
        assert optimizer is not None  # needs_optimizer: refused before
        return carry_over(optimizer, self.optimizer_kind or "", ctx.bf16_weights)


STATE_BF16 = StateLever("bf16", risk=2)
STATE_8BIT = StateLever("8bit", risk=4)
STATE_4BIT = StateLever("4bit", risk=6)
#: The optimizer-state levers, least risky first.
STATE_LEVERS = (STATE_BF16, STATE_8BIT, STATE_4BIT)
