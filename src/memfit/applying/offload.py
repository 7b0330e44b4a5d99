"""The ``offload`` lever: the plan's chosen blocks keep their saved activations in pinned host
memory (:mod:`memfit.levers.offload`, CUDA only).

It is applied when a plan names it, with its blocks as its setting (``{"blocks": [...]}``);
the planner does not choose it (its bytes are not in the step model yet).

Example:
    >>> OFFLOAD.refusal(Site(torch.device("cpu"), "AdamW", "fp32"))[:40]
    'offload moves activations to host memory'
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.applying.lever import Applying, Lever, Site
from memfit.errors import ConfigError
from memfit.levers.offload import clear_offload, offload_blocks
from memfit.records.plan import LeverSettings

__all__ = ["OFFLOAD", "OffloadLever"]


class OffloadLever(Lever):
    """Saved activations of chosen blocks in host memory."""

    name = "offload"
    order = 30
    planned = False

    def refusal(self, site: Site) -> str | None:
        if site.device.type != "cuda":
            return (
                "offload moves activations to host memory, which on a CPU is the memory they are in: it "
                "saves nothing there, so it runs on CUDA only."
            )
        return None

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
