"""The ``offload`` lever: the plan's chosen blocks keep their saved activations in pinned host
memory (:mod:`memfit.levers.offload`, CUDA only), copied on a side stream and brought back one
block ahead.

Its setting is the blocks offloaded (``{"blocks": [...]}``). The planner prices it from the
step model's events and the host link's measured speeds (:mod:`memfit.stepmodel.offload`) and
chooses it where recompute or a smaller step costs more (:mod:`memfit.planning.offloaded`);
what it measures is the host link (:func:`memfit.measuring.long_context.host_link_facts`). On a
CPU it is refused: activations are in host memory already.

Example:
    >>> OFFLOAD.refusal(Site(torch.device("cpu"), "AdamW", "fp32"))[:40]
    'offload moves activations to host memory'
    >>> OFFLOAD.unpredictable(None)
    'the host link was not measured'
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.applying.lever import Applying, Lever, Predict, Predicting, Site
from memfit.budget import format_bytes
from memfit.errors import ConfigError
from memfit.levers.offload import clear_offload, offload_blocks
from memfit.records import LeverFacts, Plan, Profile
from memfit.records.plan import LeverSettings

__all__ = ["OFFLOAD", "OffloadLever"]


class OffloadLever(Lever):
    """Saved activations of chosen blocks in host memory."""

    name = "offload"
    order = 30
    step_facts = False

    def refusal(self, site: Site) -> str | None:
        if site.device.type != "cuda":
            return (
                "offload moves activations to host memory, which on a CPU is the memory they are in: it "
                "saves nothing there, so it runs on CUDA only."
            )
        return None

    def unpredictable(self, facts: LeverFacts | None) -> str | None:
        link = facts.host_link if facts is not None else None
        if link is None:
            return "the host link was not measured"
        return link.refused or None

    def predict(self, out: Profile, ctx: Predicting) -> None:
        """Nothing per block: the price is the plan's, over the step's events
        (:func:`memfit.stepmodel.offload.offload_price`, by :mod:`memfit.planning.offloaded`)."""
        why = self.unpredictable(ctx.facts)
        if why:
            raise ConfigError(f"offload cannot be priced: {why}; plan again.")

    def note(self, plan: Plan, profile: Profile, with_levers: Predict) -> str | None:
        """Which blocks, and what the host link costs."""
        blocks = plan.setting(self.name, "blocks", [])
        link = profile.lever_facts.host_link if profile.lever_facts is not None else None
        if not blocks or link is None or link.refused:
            return None
        return (
            f"offload: {len(blocks)} blocks keep what their backward needs in pinned host memory, copied "
            f"on a side stream ({format_bytes(int(link.to_host_bytes_per_second))}/s to the host, "
            f"{format_bytes(int(link.to_device_bytes_per_second))}/s back, measured) and brought back "
            "one block ahead."
        )

    def check_settings(self, settings: LeverSettings) -> None:
        blocks = settings.get("blocks", [])
        if not isinstance(blocks, list) or not all(isinstance(b, str) for b in blocks):
            raise ConfigError(f"the offload lever's blocks must be a list of block names, got {blocks!r}.")

    def clear(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        clear_offload(model)

    def apply(self, optimizer: torch.optim.Optimizer | None, ctx: Applying) -> torch.optim.Optimizer | None:
        blocks = ctx.plan.setting(self.name, "blocks", [])
        offload_blocks(ctx.model, blocks)
        if ctx.undo is not None:
            ctx.undo.add(lambda: clear_offload(ctx.model))
        return optimizer


OFFLOAD = OffloadLever()
