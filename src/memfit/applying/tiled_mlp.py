"""The ``tiled_mlp`` lever: each block's MLP run over chunks of the sequence, recomputed chunk by
chunk in the backward, so the whole ``sequence x intermediate`` tensor never exists
(:mod:`memfit.levers.tiled_mlp`).

Exact to fp32 rounding (a parameter's gradient is the sum of its chunks'). Its setting is the
chunk count (``{"chunks": n}``), which the planner chooses
(See Note [the fewest chunks that fit]). What it measures: one MLP alone at the step's
shape, plain and at every count of the ladder, in every checkpointing mode (``step_facts``;
See Note [the MLP measured alone] in :mod:`memfit.measuring.long_context`); its bytes move
the blocks' numbers by the MLP's difference (:func:`memfit.stepmodel.tiled_mlp.with_tiled_mlp`).

Example:
    >>> TILED_MLP.unpredictable(None)
    'its MLPs were not measured'
    >>> TILED_MLP.check_settings({"chunks": 8})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from memfit.applying.lever import Applying, Lever, Predict, Predicting, Site
from memfit.budget import format_bytes
from memfit.errors import ConfigError
from memfit.levers.tiled_mlp import find_mlps, install_tiled_mlp, remove_tiled_mlp
from memfit.records import LeverFacts, Plan, Profile
from memfit.records.long_context import TiledMlpFacts
from memfit.records.plan import LeverSettings
from memfit.stepmodel.tiled_mlp import MLP_LADDER, mlp_cost_at, with_tiled_mlp

__all__ = ["TILED_MLP", "TiledMlpLever", "chosen_chunks"]

# Note [the fewest chunks that fit]
# The chunk count changes no numerics (to rounding), only the MLP's bytes and speed: more
# chunks hold a smaller piece of the intermediate and run more, smaller matmuls (one Python
# iteration each). So it is a setting of the lever, chosen inside each lever set that has it:
# the counts of the ladder (memfit.stepmodel.tiled_mlp.mlp_chunk_counts: 2, 4, ... 64, each
# measured), fewest first, and the first count with a plan that fits is kept. With the
# chunked loss head in the same set, the head's chunk varies slowest (its smallest chunks are
# far slower than 64 MLP chunks), so every MLP count is tried at the head's default chunk
# first. A lever set without tiled_mlp comes before it in the order
# (See Note [lever sets in risk order]), so a block's MLP is tiled only when no plan
# without it fits: the MLP's recompute in the backward is one more forward of it.

_CHUNKS = "chunks"


def _facts(facts: LeverFacts | None) -> TiledMlpFacts | None:
    return facts.tiled_mlp if facts is not None else None


class TiledMlpLever(Lever):
    """Each block's MLP over chunks of the sequence."""

    name = "tiled_mlp"
    order = 45
    step_facts = True

    def refusal(self, site: Site) -> str | None:
        if site.model is None:
            return None
        try:
            find_mlps(site.model)
        except ConfigError as exc:
            return str(exc)
        return None

    def unpredictable(self, facts: LeverFacts | None) -> str | None:
        tiled = _facts(facts)
        if tiled is None:
            return "its MLPs were not measured"
        if tiled.refused:
            return tiled.refused
        if not tiled.chunk_counts:
            return f"a sequence of {tiled.positions} positions is too short to split into chunks"
        return None

    def settings(self, profiles: Mapping[str, Profile]) -> list[LeverSettings]:
        """The counts tried, fewest first (See Note [the fewest chunks that fit])."""
        for prof in profiles.values():
            tiled = _facts(prof.lever_facts)
            if tiled is not None and tiled.chunk_counts:
                return [{_CHUNKS: n} for n in tiled.chunk_counts]
        return [{}]

    def at_settings(self, profile: Profile, settings: LeverSettings) -> Profile:
        chunks = settings.get(_CHUNKS, 0)
        tiled = _facts(profile.lever_facts)
        if tiled is None or not isinstance(chunks, int) or chunks == tiled.chunks:
            return profile
        assert profile.lever_facts is not None
        facts = dataclasses.replace(profile.lever_facts, tiled_mlp=dataclasses.replace(tiled, chunks=chunks))
        return dataclasses.replace(profile, lever_facts=facts)

    def check_settings(self, settings: LeverSettings) -> None:
        chunks = settings.get(_CHUNKS, 0)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 0 or set(settings) - {_CHUNKS}:
            raise ConfigError(
                "the tiled_mlp lever's settings are {'chunks': a whole number of chunks per sequence} "
                f"(0: the ladder's last, the fewest bytes), got {settings!r}."
            )

    def predict(self, out: Profile, ctx: Predicting) -> None:
        """``out``'s blocks with their MLPs tiled at the facts' count (in place)."""
        tiled = _facts(ctx.facts)
        why = self.unpredictable(ctx.facts)
        if tiled is None or why:
            raise ConfigError(f"tiled_mlp cannot be predicted: {why}; plan again.")
        chunks = chosen_chunks(tiled)
        out.blocks = with_tiled_mlp(out, tiled, chunks).blocks
        out.notes = [
            *out.notes,
            f"tiled_mlp: {len(tiled.modules)} MLPs in {chunks} chunks of the sequence, each recomputed in "
            "the backward.",
        ]

    def note(self, plan: Plan, profile: Profile, with_levers: Predict) -> str | None:
        """How many chunks, and what that takes off one MLP (See Note [the fewest chunks that fit])."""
        tiled = _facts(profile.lever_facts)
        if tiled is None or not tiled.chunk_counts:
            return None
        chunks = plan.setting(self.name, _CHUNKS) or chosen_chunks(tiled)
        modes: list[str] = [m for m in plan.blocks.values() if m in tiled.plain] or list(tiled.plain)
        mode = max(set(modes), key=modes.count)
        plain, at = tiled.plain[mode], mlp_cost_at(tiled, chunks, mode)
        fewer = [n for n in tiled.chunk_counts if n < chunks]
        why = (
            "the fewest of the ladder"
            if not fewer
            else f"the fewest of the ladder ({', '.join(map(str, tiled.chunk_counts))}) a plan fits with"
        )
        return (
            f"tiled_mlp: {len(tiled.modules)} MLPs ({tiled.positions:,} positions x {tiled.rows} rows) in "
            f"{chunks} chunks, {why}; one MLP's backward peaks at {format_bytes(at.backward_peak_bytes)} "
            f"tiled against {format_bytes(plain.backward_peak_bytes)} plain ({mode} checkpointing), for one "
            "more forward of each MLP in the backward."
        )

    def clear(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        remove_tiled_mlp(model)

    def apply(self, optimizer: torch.optim.Optimizer | None, ctx: Applying) -> torch.optim.Optimizer | None:
        chunks = ctx.plan.setting(self.name, _CHUNKS) or MLP_LADDER[-1]  # as chosen_chunks prices it
        install_tiled_mlp(ctx.model, chunks)
        if ctx.undo is not None:
            ctx.undo.add(lambda: remove_tiled_mlp(ctx.model))
        return optimizer


def chosen_chunks(tiled: TiledMlpFacts) -> int:
    """The count a profile's tiled MLP is priced at: the planner's setting, else the ladder's last
    (the fewest bytes: what the lever can save, for ``memfit estimate``; a plan without a
    setting is applied so).

    Example:
        >>> chosen_chunks(TiledMlpFacts(positions=100, chunk_counts=[2, 4, 8, 16, 32, 64]))
        64
    """
    return tiled.chunks or (tiled.chunk_counts[-1] if tiled.chunk_counts else 1)


TILED_MLP = TiledMlpLever()
