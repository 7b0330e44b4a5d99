"""A decision the planner made: :class:`Plan` (plain data; ``memfit.apply`` acts on it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from memfit.errors import ConfigError
from memfit.records.base import Record
from memfit.vocab import LEVERS, CheckpointMode, PrecisionName, normalize_modes

__all__ = ["MAX_MICRO_BATCHES", "Plan"]

#: More micro-batches than any batch holds rows (and than torch's index arithmetic takes).
MAX_MICRO_BATCHES = 2**31 - 1


@dataclass
class Plan(Record):
    """A decision: how to checkpoint each block, which precision, how many micro-batches.

    A Plan is plain data; :func:`memfit.apply` is the only thing that acts on it.
    """

    blocks: dict[str, CheckpointMode]
    """``{block name: "none" | "selective" | "full"}`` (``"keep"`` from older plans reads as ``"none"``)."""
    precision: PrecisionName = "fp32"
    micro_batches: int = 1
    predicted_peak_bytes: int = 0
    predicted_step_seconds: float = 0.0
    baseline_peak_bytes: int = 0
    baseline_step_seconds: float = 0.0
    baseline_from: str = "tracked"
    """How ``baseline_peak_bytes`` was found: ``"tracked"`` (a real step) or ``"fake tensors"``
    (the plain step does not fit the device, so it was measured on a fake-tensor twin)."""
    budget_bytes: int = 0
    measured_peak_bytes: int = 0
    """The plan's peak as measured when it was made (0: not measured)."""
    batch_size: int = 0
    """The batch the plan was made for (with ``maximize="batch_size"``: the largest that fits);
    0 when not recorded (older plans)."""
    notes: list[str] = field(default_factory=list)
    """What the user should know about the plan (e.g. BatchNorm sees micro-batches)."""
    segments: list[list[str]] = field(default_factory=list)
    """Runs of consecutive blocks checkpointed as one segment (``checkpoint_sequential``'s
    way: one call, only the run's input and last output kept); their blocks read ``full``
    in :attr:`blocks`. Empty in plans made before segments existed."""
    planning_seconds: float = 0.0
    """Wall time ``memfit.plan`` took to make this plan (0: not recorded)."""
    measured: list[str] = field(default_factory=list)
    """What planning ran, one line each (steps tracked and timed, micro-benchmarks)."""
    levers: list[str] = field(default_factory=list)
    """Levers beyond activations the plan uses (:mod:`memfit.levers`): ``fused_step``,
    ``state_bf16`` / ``state_8bit`` / ``state_4bit``, ``weights_bf16``, ``offload``. Empty: none."""
    offload: list[str] = field(default_factory=list)
    """Blocks whose saved activations go to host memory (with the ``offload`` lever)."""
    lever_savings: dict[str, int] = field(default_factory=dict)
    """Per lever used: predicted bytes of the step's peak it saves (the plan without it minus
    the plan)."""
    loss_chunk_tokens: int = 0
    """Tokens per chunk of the ``chunked_loss`` lever's loss head (the planner's choice; see
    docs/levers.md); 0: the default for the vocabulary (``2**23 // vocab``)."""

    def __post_init__(self) -> None:
        # one spelling of the modes (memfit.vocab); plans saved with "keep" still load
        if not isinstance(self.blocks, Mapping):
            raise ConfigError(
                f"a plan's blocks must map block names to modes, got {type(self.blocks).__name__}; "
                "make the plan again with memfit plan."
            )
        self.blocks = dict(normalize_modes(self.blocks))
        mb = self.micro_batches
        if isinstance(mb, bool) or not isinstance(mb, int) or not 1 <= mb <= MAX_MICRO_BATCHES:
            shown = repr(mb) if len(repr(mb)) <= 24 else f"a number of {len(repr(mb))} digits"
            raise ConfigError(
                f"a plan's micro_batches must be a whole number from 1 to {MAX_MICRO_BATCHES}, got {shown}; "
                "make the plan again with memfit plan."
            )
        unknown = [n for n in self.levers if n not in LEVERS]
        if unknown:
            raise ConfigError(
                f"the plan's lever {unknown[0]!r} is not one of {', '.join(LEVERS)}; make the plan again."
            )
        chunk = self.loss_chunk_tokens
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ConfigError(
                "a plan's loss_chunk_tokens must be a whole number of tokens (0: the default), "
                f"got {chunk!r}."
            )
        if chunk and "chunked_loss" not in self.levers:
            raise ConfigError(
                "the plan sets loss_chunk_tokens but does not list the 'chunked_loss' lever; add it."
            )
        if self.offload and "offload" not in self.levers:
            raise ConfigError("the plan offloads blocks but does not list the 'offload' lever; add it.")
        for seg in self.segments:
            inside = [n for n in seg if self.blocks.get(n) != "full"]
            if len(seg) < 2 or inside:
                raise ConfigError(
                    f"the plan's segment {seg} needs two or more blocks, each 'full' in its blocks; "
                    "make the plan again with memfit plan."
                )
