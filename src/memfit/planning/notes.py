"""The notes a plan carries (what the time model rests on, ties, BatchNorm with micro-batches,
in-place writes in the blocks it checkpoints) and whether a profile has every mode measured.

Example:
    >>> from memfit.records import BlockStats, Profile
    >>> complete_profile(Profile("fp32", "cpu", 1, [BlockStats("b0", saved_bytes={"none": 1})],
    ...                          BlockStats("outside"), 0, 0, 0, 0))
    False
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from memfit.measuring.inplace import inplace_parts
from memfit.planning.choose import TIE
from memfit.records import Plan, Profile
from memfit.stepmodel import time_note
from memfit.vocab import CHECKPOINT_MODES

__all__ = ["complete_profile", "plan_notes"]


def complete_profile(profile: Profile) -> bool:
    """Whether every block was measured in every checkpointing mode."""
    return all(set(CHECKPOINT_MODES) <= set(b.saved_bytes) for b in profile.blocks)


def plan_notes(model: nn.Module, result: Plan, profiles: Mapping[str, Profile]) -> list[str]:
    notes = [
        time_note(profiles[result.precision]),
        f"plans predicted within {TIE:.0%} of the fastest step count as ties (the time model resolves "
        "no finer); the one with the lowest peak is chosen, so the same model gets the same plan.",
    ]
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if result.micro_batches > 1 and norms:
        notes.append(
            f"{len(norms)} BatchNorm layer(s) (e.g. {norms[0]!r}) normalise over each micro-batch, not the "
            f"whole batch, with {result.micro_batches} micro-batches; give a larger budget to avoid it."
        )
    if "fused_step" in result.levers:
        notes.append(
            "fused_step: with clip_norm the last micro-batch's backward runs twice (norms first, then the "
            "steps), which the predicted step time does not include; without clipping it adds no work."
        )
    # NOTE: the profile's notes on in-place writes, for the blocks the plan runs in those modes.
    for note in profiles[result.precision].notes:
        blocks, modes = inplace_parts(note)
        if any(result.blocks.get(b) in modes for b in blocks):
            notes.append(note)
    return notes
