"""memfit: train PyTorch models in less memory.

Mixed precision and activation checkpointing, measured with PyTorch's own tracking and
planned to fit a byte budget. Data flows one way: measure -> plan -> apply -> run -> report.

The top level holds the verbs and the few types a user holds; everything else lives in
the module that owns it (records in :mod:`memfit.records`, errors in :mod:`memfit.errors`,
budgets in :mod:`memfit.budget`, the built-in GPT in :mod:`memfit.models.gpt`, guards and
thresholds in :mod:`memfit.check`). See docs/ARCHITECTURE.md for the map.

Example:
    >>> import torch, memfit
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> memfit.find_blocks(model)
    ['blocks.0', 'blocks.1']
    >>> _ = memfit.checkpoint(model, mode="selective")
"""

from memfit.apply import apply
from memfit.benchmarking.sweep import bench
from memfit.check.stability import check_stability
from memfit.checkpointing import checkpoint, find_blocks, uncheckpoint
from memfit.errors import InfeasibleBudget, MemfitError, NonFiniteLoss
from memfit.loop import prepare, train_step
from memfit.measuring.estimate import estimate
from memfit.measuring.memory import measure
from memfit.measuring.profile import profile
from memfit.planning.planner import plan
from memfit.precision import Precision
from memfit.records import Plan
from memfit.trainer.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "InfeasibleBudget",
    "MemfitError",
    "NonFiniteLoss",
    "Plan",
    "Precision",
    "Trainer",
    "__version__",
    "apply",
    "bench",
    "check_stability",
    "checkpoint",
    "estimate",
    "find_blocks",
    "measure",
    "plan",
    "prepare",
    "profile",
    "train_step",
    "uncheckpoint",
]
