"""The ``chunked_loss`` lever: the loss head (projection and cross-entropy) in chunks of
tokens, so the whole logits tensor never exists (:mod:`memfit.levers.head`).

Exact to fp32 rounding; the model's output has no logits when it computes the loss. Its
setting is the chunk (``{"chunk_tokens": n}``; none: the default for the vocabulary), which
the planner chooses: See Note [the largest chunk that fits]. What it measures: the head
alone, plain and chunked, at the step's shape (``step_facts``;
See Note [the head measured alone] in :mod:`memfit.measuring.lever_facts`); its bytes move
the outside's numbers from the plain head's to the chunked head's.

Example:
    >>> CHUNKED_LOSS.unpredictable(None)
    'its loss head was not measured'
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from memfit.applying.lever import Applying, Lever, Predict, Predicting, Site
from memfit.budget import format_bytes
from memfit.errors import ConfigError
from memfit.levers.head import head_refusal, install_chunked_head, remove_chunked_head
from memfit.records import LeverFacts, Plan, Profile
from memfit.records.plan import LeverSettings
from memfit.stepmodel import simulate
from memfit.stepmodel.head_chunks import at_chunk, chunk_fixed_bytes, chunk_ladder, head_cost_at

__all__ = ["CHUNKED_LOSS", "ChunkedLossLever"]

# Note [the largest chunk that fits]
# The chunk size of chunked_loss changes no numerics, only the head's bytes and speed: one
# chunk's logits are made at a time, and a smaller chunk runs more, smaller matmuls (one
# Python iteration each). So it is a setting of the lever, chosen inside each lever set
# that has it: the default chunk first (2**23 // vocab tokens, 32 MiB of fp32 logits:
# matmuls large enough to run at speed; much smaller chunks are slower), then each smaller
# rung of the ladder (memfit.stepmodel.head_chunks.chunk_ladder: /4 per rung, down to 1
# token), and the first rung with a plan that fits is kept: the largest chunk that fits,
# the default when it does. At the default chunk the plan may use checkpointing or
# micro-batches (the time model prices micro-batches as the same work), so a smaller
# chunk is chosen only when no plan at a larger one fits (e.g. a batch of one row). A
# lever set without chunked_loss comes before it in the order, so a small head is never
# chunked when a plan without the lever fits.

_CHUNK = "chunk_tokens"


class ChunkedLossLever(Lever):
    """The loss head in chunks of tokens."""

    name = "chunked_loss"
    order = 40
    step_facts = True

    def refusal(self, site: Site) -> str | None:
        return None if site.model is None else head_refusal(site.model)

    def unpredictable(self, facts: LeverFacts | None) -> str | None:
        head = facts.head if facts is not None else None
        return "its loss head was not measured" if head is None else (head.refused or None)

    def settings(self, profiles: Mapping[str, Profile]) -> list[LeverSettings]:
        """The chunks tried, largest first (See Note [the largest chunk that fits]): the default
        as measured, then the smaller rungs of :func:`~memfit.stepmodel.head_chunks.chunk_ladder`
        (just the default when the head was measured at one chunk size only)."""
        for prof in profiles.values():
            head = prof.lever_facts.head if prof.lever_facts is not None else None
            if head is not None and head.default_chunk_tokens and head.small_chunk_tokens:
                # the default itself first (a plan for a batch of more tokens keeps it)
                ladder = [head.chunk_tokens, *chunk_ladder(head.default_chunk_tokens)[1:]]
                return [{_CHUNK: chunk} for chunk in ladder]
        return [{}]

    def at_settings(self, profile: Profile, settings: LeverSettings) -> Profile:
        chunk = settings.get(_CHUNK, 0)
        return at_chunk(profile, chunk if isinstance(chunk, int) else 0)

    def check_settings(self, settings: LeverSettings) -> None:
        chunk = settings.get(_CHUNK, 0)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0 or set(settings) - {_CHUNK}:
            raise ConfigError(
                "the chunked_loss lever's settings are {'chunk_tokens': a whole number of tokens} "
                f"(0: the default), got {settings!r}."
            )

    def predict(self, out: Profile, ctx: Predicting) -> None:
        """``out``'s outside with the chunked head instead of the plain one (in place)."""
        head = ctx.facts.head
        if head is None or head.refused:
            why = head.refused if head is not None else "this profile has no loss-head facts; plan again"
            raise ConfigError(f"chunked_loss cannot be predicted: {why}")
        plain, chunked = head.plain, head.chunked
        o = out.outside
        saved = chunked.saved_bytes - plain.saved_bytes
        o.saved_bytes = {m: max(0, v + saved) for m, v in o.saved_bytes.items()}
        delta = chunked.forward_peak_bytes - plain.forward_peak_bytes
        o.forward_peak_bytes = {m: max(0, v + delta) for m, v in o.forward_peak_bytes.items()}
        delta = chunked.backward_peak_bytes - plain.backward_peak_bytes
        o.backward_peak_bytes = {m: max(0, v + delta) for m, v in o.backward_peak_bytes.items()}
        # one chunk's logits do not shrink with micro-batches:
        # See Note [the head's bytes are affine in the chunk]
        o.forward_fixed_bytes += head.weight_grad_bytes + chunk_fixed_bytes(head, head.chunk_tokens)
        out.activation_bytes = max(0, out.activation_bytes + chunked.saved_bytes - plain.saved_bytes)
        out.notes = [
            *out.notes,
            f"chunked_loss: the loss head in chunks of {head.chunk_tokens} tokens; the model's output has "
            "no logits when it computes the loss.",
        ]

    def note(self, plan: Plan, profile: Profile, with_levers: Predict) -> str | None:
        """Why the plan's chunks are of their size (See Note [the largest chunk that fits])."""
        facts = profile.lever_facts
        if facts is None or facts.head is None:
            return None
        h = facts.head
        default = h.chunk_tokens
        chunk = plan.setting(self.name, _CHUNK) or default
        moved = head_cost_at(h, chunk)
        if chunk == default:
            why = (
                f"chunks of {chunk:,} tokens, the default (2**23 // vocabulary: 32 MiB of fp32 logits a "
                "chunk), chosen because the plan fits with it and larger chunks run fewer, larger matmuls"
            )
        else:
            at_default = simulate(
                with_levers(profile, plan.levers), plan.blocks, plan.micro_batches, plan.segments
            ).peak_bytes
            why = (
                f"chunks of {chunk:,} tokens, chosen because at the default {default:,} tokens no plan with "
                f"these levers fits the budget of {format_bytes(plan.budget_bytes)} (this one is predicted "
                f"at {format_bytes(at_default)}); {chunk:,} is the largest chunk of the ladder "
                f"({', '.join(f'{c:,}' for c in chunk_ladder(min(default, h.tokens)))}) that fits, and "
                "smaller chunks run more, smaller matmuls"
            )
        return (
            f"chunked_loss: {why}; the loss head ({h.tokens:,} tokens x {h.vocab:,} vocabulary) peaks at "
            f"{moved.forward_peak_bytes:,} B in its forward chunked, {h.plain.forward_peak_bytes:,} B plain. "
            "The model's output has no logits (None) when it computes the loss (labels= / targets=); "
            "without labels it is unchanged."
        )

    def clear(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        remove_chunked_head(model)

    def apply(self, optimizer: torch.optim.Optimizer | None, ctx: Applying) -> torch.optim.Optimizer | None:
        install_chunked_head(ctx.model, ctx.plan.setting(self.name, _CHUNK) or None)
        if ctx.undo is not None:
            ctx.undo.add(lambda: remove_chunked_head(ctx.model))
        return optimizer


CHUNKED_LOSS = ChunkedLossLever()
