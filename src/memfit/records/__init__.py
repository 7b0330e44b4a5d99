"""Plain records that cross module borders, each with a JSON round-trip, one module per stage.

Measuring produces them (:mod:`.memory`, :mod:`.profile`, :mod:`.estimate`), planning
reads and writes them (:mod:`.plan`), running, checking and benchmarking report them
(:mod:`.train`, :mod:`.check`, :mod:`.bench`). They hold numbers only (no tensors, no
modules), so a record written on one machine can be read, planned over and reported on
another. Every record is re-exported here.

Example:
    >>> r = MemoryReport(peak_bytes=10, breakdown={"params": 4, "activations": 6})
    >>> MemoryReport.from_json(r.to_json()) == r
    True
"""

from memfit.records.base import Record
from memfit.records.bench import BenchPoint
from memfit.records.check import ModuleRange, NonFinite, PrecisionCheck, RunCurve, StabilityReport
from memfit.records.estimate import Estimate, EstimateEntry
from memfit.records.lever_facts import HeadCost, HeadFacts, LeverFacts
from memfit.records.memory import BREAKDOWN_KEYS, MemoryReport
from memfit.records.plan import MadeFor, Plan, PlanReport
from memfit.records.profile import BlockStats, Profile, Speed
from memfit.records.train import StepMetrics

__all__ = [
    "BREAKDOWN_KEYS",
    "BenchPoint",
    "BlockStats",
    "Estimate",
    "EstimateEntry",
    "HeadCost",
    "HeadFacts",
    "LeverFacts",
    "MadeFor",
    "MemoryReport",
    "ModuleRange",
    "NonFinite",
    "Plan",
    "PlanReport",
    "PrecisionCheck",
    "Profile",
    "Record",
    "RunCurve",
    "Speed",
    "StabilityReport",
    "StepMetrics",
]
