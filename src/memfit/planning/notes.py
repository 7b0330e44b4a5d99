"""The notes a plan carries (what the time model rests on, ties, BatchNorm with micro-batches,
each lever's own note, in-place writes in the blocks it checkpoints) and whether a profile has
every mode measured.

Example:
    >>> from memfit.records import BlockStats, Profile
    >>> complete_profile(Profile("fp32", "cpu", 1, [BlockStats("b0", saved_bytes={"none": 1})],
    ...                          BlockStats("outside"), 0, 0, 0, 0))
    False
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from memfit.applying.registry import lever, with_levers
from memfit.checkpointing import block_reasons
from memfit.measuring.inplace import inplace_parts
from memfit.planning.choose import NOISE_CAP, TIE
from memfit.planning.standard import PREFER_STANDARD, STANDARD_NAMES, standard_name, standard_solutions
from memfit.records import Plan, Profile
from memfit.stepmodel import predict_options_seconds, time_note
from memfit.vocab import CHECKPOINT_MODES

__all__ = ["block_notes", "complete_profile", "plan_notes", "standard_note"]


def complete_profile(profile: Profile) -> bool:
    """Whether every block was measured in every checkpointing mode."""
    return all(set(CHECKPOINT_MODES) <= set(b.saved_bytes) for b in profile.blocks)


def standard_note(result: Plan, profile: Profile) -> str | None:
    """One sentence: which PyTorch configuration the plan is, or how much faster than the best one it is."""
    if not profile.blocks or any(b.name not in result.blocks for b in profile.blocks):
        return None
    modes = [result.blocks[b.name] for b in profile.blocks]
    name = standard_name(profile, modes, result.segments)
    if name == "none":
        return None
    if name is not None:
        return (
            f"the plan is PyTorch's own {name!r} configuration ({STANDARD_NAMES[name]}): no other plan that "
            f"fits was predicted {PREFER_STANDARD:.0%} of a step faster."
        )
    fitting = standard_solutions(profile, result.budget_bytes, result.micro_batches)
    if not fitting:
        return (
            "none of PyTorch's own configurations (full, every 2nd block, checkpoint_sequential, selective) "
            "fits this budget."
        )
    timed = [(predict_options_seconds(profile, s.options, result.micro_batches), n) for n, s in fitting]
    seconds, best = min(timed)
    if result.report.predicted_step_seconds <= 0:
        return f"the plan is not one of PyTorch's own configurations; of those, {best!r} fits."
    return (
        f"the fastest PyTorch configuration that fits, {best!r} ({STANDARD_NAMES[best]}), is predicted at "
        f"{seconds / result.report.predicted_step_seconds:.2f}x this plan's step time; a plan of memfit's "
        f"own is chosen only {PREFER_STANDARD:.0%} of a step faster or more."
    )


def block_notes(model: nn.Module, blocks: Mapping[str, str]) -> list[str]:
    """Why the blocks were chosen, one line per reason (:func:`memfit.checkpointing.block_reasons`).

    Example:
        >>> block_notes(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), {"0": "full", "1": "none"})
        ['blocks 0 and 1: repeated 2x (Linear), the largest unit that repeats']
    """
    groups: dict[str, list[str]] = {}
    for name, why in block_reasons(model).items():
        if name in blocks:
            groups.setdefault(why, []).append(name)
    lines = []
    for why, names in groups.items():
        which = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        if len(names) > 3:
            which = f"{names[0]} ... {names[-1]} ({len(names)})"
        lines.append(f"block{'s' if len(names) > 1 else ''} {which}: {why}")
    return lines


def _tie_note(prof: Profile) -> str:
    """How close plans count as equally fast; see Note [plans repeat] (memfit.planning.choose)."""
    spread = min(prof.speed.spread if prof.speed is not None else 0.0, NOISE_CAP)
    return (
        f"plans predicted within {TIE:.0%} of the fastest step, plus {spread:.0%} of their checkpointing "
        "extras (the spread measured in this machine's block times while profiling), count as ties; ties go "
        "to the fewest ops selective checkpointing dispatches, then the fewest recomputed FLOPs, then "
        "the lowest peak, so the same call gets the same plan."
    )


def plan_notes(model: nn.Module, result: Plan, profiles: Mapping[str, Profile]) -> list[str]:
    notes = [
        *block_notes(model, result.blocks),
        time_note(profiles[result.precision]),
        _tie_note(profiles[result.precision]),
    ]
    std = standard_note(result, profiles[result.precision])
    if std is not None:
        notes.append(std)
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if result.micro_batches > 1 and norms:
        notes.append(
            f"{len(norms)} BatchNorm layer(s) (e.g. {norms[0]!r}) normalise over each micro-batch, not the "
            f"whole batch, with {result.micro_batches} micro-batches; give a larger budget to avoid it."
        )
    for name in result.levers:  # each lever's own note (memfit.applying)
        note = lever(name).note(result, profiles[result.precision], with_levers)
        if note is not None:
            notes.append(note)
    # The profile's notes on in-place writes, for the blocks the plan runs in those modes.
    for note in profiles[result.precision].notes:
        blocks, modes = inplace_parts(note)
        if any(result.blocks.get(b) in modes for b in blocks):
            notes.append(note)
    return notes
