"""memfit: train PyTorch models in less memory.

Mixed precision and activation checkpointing, measured with PyTorch's own tracking and
planned to fit a byte budget. Data flows one way: measure -> plan -> apply -> run -> report.

Example:
    >>> import torch, memfit
    >>> from memfit.train.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> memfit.find_blocks(model)
    ['blocks.0', 'blocks.1']
    >>> _ = memfit.checkpoint(model, mode="selective")
"""

from memfit.budget import format_bytes, parse_bytes
from memfit.check.attribution import attribute
from memfit.check.guards import Guard, GuardConfig
from memfit.check.stability import check_stability
from memfit.check.verdict import Thresholds
from memfit.checkpointing import (
    checkpoint,
    checkpointed_blocks,
    find_blocks,
    uncheckpoint,
)
from memfit.errors import (
    ConfigError,
    InfeasibleBudget,
    MemfitError,
    NonFiniteLoss,
    StateError,
    UnsupportedPrecision,
)
from memfit.measure.bench import bench
from memfit.measure.estimate import estimate
from memfit.measure.memory import measure
from memfit.measure.profile import profile
from memfit.measure.strategies import Strategy
from memfit.plan.planner import apply, plan
from memfit.precision import Precision
from memfit.records import (
    BenchPoint,
    BlockStats,
    Estimate,
    EstimateEntry,
    MemoryReport,
    NonFinite,
    Plan,
    Profile,
    StabilityReport,
    StepMetrics,
)
from memfit.train.build import ModelSpec
from memfit.train.callbacks import Callback
from memfit.train.gpt import GPT, GPTConfig, gpt_loss
from memfit.train.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "BenchPoint",
    "BlockStats",
    "Callback",
    "ConfigError",
    "Estimate",
    "EstimateEntry",
    "GPTConfig",
    "Guard",
    "GuardConfig",
    "InfeasibleBudget",
    "MemfitError",
    "MemoryReport",
    "ModelSpec",
    "NonFinite",
    "NonFiniteLoss",
    "Plan",
    "Precision",
    "Profile",
    "StabilityReport",
    "StateError",
    "StepMetrics",
    "Strategy",
    "Thresholds",
    "Trainer",
    "UnsupportedPrecision",
    "__version__",
    "apply",
    "attribute",
    "bench",
    "check_stability",
    "checkpoint",
    "checkpointed_blocks",
    "estimate",
    "find_blocks",
    "format_bytes",
    "gpt_loss",
    "measure",
    "parse_bytes",
    "plan",
    "profile",
    "uncheckpoint",
]
