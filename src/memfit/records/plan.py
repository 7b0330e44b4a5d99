"""A decision the planner made (:class:`Plan`), what it was made for (:class:`MadeFor`) and
what planning found (:class:`PlanReport`).

The decision holds what applying needs and nothing else: each block's checkpointing, the
segments, the precision, the micro-batches, the levers and their settings (e.g. the loss
head's chunk). What planning found (predicted and baseline bytes and seconds, the budget,
the measured peak, notes, what was measured and what estimated) is a separate record,
:attr:`Plan.report`, built once when the planner returns. Both are frozen: a plan is made
whole (``dataclasses.replace`` makes a changed copy), never patched.

``plan.json`` files keep both; those written before the split (one flat object) still read.

Example:
    >>> p = Plan(blocks={"blocks.0": "full"}, levers=["chunked_loss"],
    ...          lever_settings={"chunked_loss": {"chunk_tokens": 128}})
    >>> p.setting("chunked_loss", "chunk_tokens"), p.predicted_peak_bytes
    (128, 0)
    >>> Plan.from_json(p.to_json()) == p
    True
    >>> Plan.from_dict({"blocks": {}, "predicted_peak_bytes": 7}).report.predicted_peak_bytes
    7
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from memfit.errors import ConfigError
from memfit.records.base import Record
from memfit.vocab import CheckpointMode, PrecisionName, normalize_modes

__all__ = ["MAX_MICRO_BATCHES", "LeverSettings", "MadeFor", "Plan", "PlanReport"]

#: More micro-batches than any batch holds rows (and than torch's index arithmetic takes).
MAX_MICRO_BATCHES = 2**31 - 1

#: One lever's settings: ``{"chunk_tokens": 128}`` for ``chunked_loss``, ``{"blocks": [...]}``
#: for ``offload`` (each lever names and checks its own; :mod:`memfit.applying`).
LeverSettings = dict[str, int | list[str]]

_P = TypeVar("_P", bound="Plan")


@dataclass(frozen=True)
class MadeFor(Record):
    """What a plan was made for; applying it to another model, batch or device is refused.

    Example:
        >>> MadeFor("GPT", "1a2b", 123, [[8, 16], [8, 16]], "cpu").batch_rows
        8
    """

    model: str = ""
    """The model's class name (for the message)."""
    parameters: str = ""
    """A digest of the model's parameter names and shapes (not their dtypes: levers change those)."""
    parameter_count: int = 0
    batch: list[list[int]] = field(default_factory=list)
    """The shape of each tensor of the batch planned for (the first dimension is the batch)."""
    device: str = ""
    """The device type planned on (``cpu``, ``cuda``)."""

    @property
    def batch_rows(self) -> int:
        """The batch's first dimension (0: not recorded)."""
        return self.batch[0][0] if self.batch and self.batch[0] else 0


@dataclass(frozen=True)
class PlanReport(Record):
    """What planning found: predictions, the baseline, the budget, what was measured."""

    predicted_peak_bytes: int = 0
    predicted_step_seconds: float = 0.0
    baseline_peak_bytes: int = 0
    baseline_step_seconds: float = 0.0
    baseline_from: str = "tracked"
    """How ``baseline_peak_bytes`` was found: ``"tracked"`` (a real step) or ``"fake tensors"``
    (on a fake-tensor twin, as the planner measures wherever the twin runs)."""
    baseline_fits: bool = True
    """The step without checkpointing fits the device's room (False: it ran only on the twin)."""
    budget_bytes: int = 0
    measured_peak_bytes: int = 0
    """The plan's peak as measured when it was made (0: not measured)."""
    notes: list[str] = field(default_factory=list)
    """What the user should know about the plan (e.g. BatchNorm sees micro-batches)."""
    measured: list[str] = field(default_factory=list)
    """What planning ran, one line each (steps tracked and timed, micro-benchmarks); what was
    estimated instead (on fake tensors) is in :attr:`notes` and :attr:`baseline_from`."""
    lever_savings: dict[str, int] = field(default_factory=dict)
    """Per lever used: predicted bytes of the step's peak it saves (the plan without it minus
    the plan)."""
    planning_seconds: float = 0.0
    """Wall time ``memfit.plan`` took to make this plan (0: not recorded)."""


#: The fields of the flat plan.json written before the decision and the report were apart.
_FLAT_REPORT = {f.name for f in dataclasses.fields(PlanReport)}


@dataclass(frozen=True)
class Plan(Record):
    """A decision: how to checkpoint each block, which precision, how many micro-batches, which
    levers with which settings. :func:`memfit.apply` (and :func:`memfit.prepare`) act on it.
    """

    blocks: dict[str, CheckpointMode]
    """``{block name: "none" | "selective" | "full"}`` (``"keep"`` from older plans reads as
    ``"none"``: See Note [the old spelling keep] in :mod:`memfit.vocab`)."""
    precision: PrecisionName = "fp32"
    micro_batches: int = 1
    segments: list[list[str]] = field(default_factory=list)
    """Runs of consecutive blocks checkpointed as one segment (``checkpoint_sequential``'s
    way: one call, only the run's input and last output kept); their blocks read ``full``
    in :attr:`blocks`."""
    levers: list[str] = field(default_factory=list)
    """Levers beyond activations the plan uses (:mod:`memfit.applying`), least risky first
    in the registry's order. Empty: none."""
    lever_settings: dict[str, LeverSettings] = field(default_factory=dict)
    """Per lever of :attr:`levers` that has settings, its settings (``chunked_loss``:
    ``chunk_tokens``; ``offload``: ``blocks``)."""
    batch_size: int = 0
    """The batch the plan was made for (with ``maximize="batch_size"``: the largest that fits);
    0 when not recorded."""
    seq_len: int = 0
    """With ``maximize="seq_len"``: the longest sequence (tokens per row) one plan fits, the
    length it was made for; 0 when not recorded."""
    made_for: MadeFor | None = None
    """The model, batch and device the planner made it for (None: a plan written by hand)."""
    report: PlanReport = field(default_factory=PlanReport, compare=False)
    """What planning found (not part of the decision: two plans that decide the same are equal)."""

    def __post_init__(self) -> None:
        # one spelling of the modes (memfit.vocab); plans saved with "keep" still load
        if not isinstance(self.blocks, Mapping):
            raise ConfigError(
                f"a plan's blocks must map block names to modes, got {type(self.blocks).__name__}; "
                "make the plan again with memfit plan."
            )
        object.__setattr__(self, "blocks", dict(normalize_modes(self.blocks)))
        mb = self.micro_batches
        if isinstance(mb, bool) or not isinstance(mb, int) or not 1 <= mb <= MAX_MICRO_BATCHES:
            shown = repr(mb) if len(repr(mb)) <= 24 else f"a number of {len(repr(mb))} digits"
            raise ConfigError(
                f"a plan's micro_batches must be a whole number from 1 to {MAX_MICRO_BATCHES}, got {shown}; "
                "make the plan again with memfit plan."
            )
        unset = [n for n in self.lever_settings if n not in self.levers]
        if unset:
            raise ConfigError(
                f"the plan sets {unset[0]!r}'s settings but does not list the {unset[0]!r} lever; add it."
            )
        for seg in self.segments:
            inside = [n for n in seg if self.blocks.get(n) != "full"]
            if len(seg) < 2 or inside:
                raise ConfigError(
                    f"the plan's segment {seg} needs two or more blocks, each 'full' in its blocks; "
                    "make the plan again with memfit plan."
                )

    def setting(self, lever: str, key: str, default: Any = 0) -> Any:
        """One setting of one of the plan's levers (``default`` when the plan does not set it)."""
        return self.lever_settings.get(lever, {}).get(key, default)

    @property
    def predicted_peak_bytes(self) -> int:
        """The step's predicted peak (:attr:`report`)."""
        return self.report.predicted_peak_bytes

    @property
    def budget_bytes(self) -> int:
        """The budget in bytes the plan was made for (:attr:`report`)."""
        return self.report.budget_bytes

    @property
    def measured_peak_bytes(self) -> int:
        """The plan's peak as measured by the planner (0: not measured; :attr:`report`)."""
        return self.report.measured_peak_bytes

    @property
    def notes(self) -> list[str]:
        """What the user should know about the plan (:attr:`report`)."""
        return self.report.notes

    @classmethod
    def from_dict(cls: type[_P], data: dict[str, Any]) -> _P:
        """Read a plan, also one written as one flat object before the report was apart.

        Raises:
            ConfigError: not a plan (one sentence naming the field).
        """
        if isinstance(data, dict) and "report" not in data and _FLAT_REPORT & set(data):
            data = _from_flat(data)
        return super().from_dict(data)


def _from_flat(data: dict[str, Any]) -> dict[str, Any]:
    """A flat plan.json (memfit 0.1) in today's layout: the report's fields apart, the loss
    chunk and offloaded blocks as their levers' settings."""
    out = {k: v for k, v in data.items() if k not in _FLAT_REPORT}
    out["report"] = {k: v for k, v in data.items() if k in _FLAT_REPORT}
    settings: dict[str, Any] = {}
    chunk = out.pop("loss_chunk_tokens", 0)
    if chunk:
        settings["chunked_loss"] = {"chunk_tokens": chunk}
    offload = out.pop("offload", [])
    if offload:
        settings["offload"] = {"blocks": offload}
    if settings:
        out["lever_settings"] = settings
    return out
