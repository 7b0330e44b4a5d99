"""memfit: train PyTorch models in less memory.

Mixed precision and activation checkpointing, measured with PyTorch's own tracking and
planned to fit a byte budget. Data flows one way: measure -> plan -> apply -> run -> report.

The top level holds the verbs and the few types a user holds; everything else lives in
the module that owns it (records in :mod:`memfit.records`, errors in :mod:`memfit.errors`,
budgets in :mod:`memfit.budget`, the built-in GPT in :mod:`memfit.models.gpt`, guards and
thresholds in :mod:`memfit.check`). See docs/ARCHITECTURE.md for the map. The names are
imported when first used, so ``import memfit`` alone imports no torch.

Example:
    >>> import torch, memfit
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> memfit.find_blocks(model)
    ['blocks.0', 'blocks.1']
    >>> _ = memfit.checkpoint(model, mode="selective")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memfit.applying import apply
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

# Note [the lazy top level]
# Importing torch takes seconds, and `memfit --help` or `memfit --version` need none of it,
# so the top-level names are looked up on first use (PEP 562 `__getattr__`) in the module
# that defines them, then kept. No top-level name is also the name of a module of memfit:
# importing a submodule sets it as an attribute of the package, which would replace the
# name (`memfit.apply` is defined in memfit/applying/, so nothing replaces it).

#: Top-level name -> the module that defines it.
_WHERE: dict[str, str] = {
    "apply": "memfit.applying",
    "bench": "memfit.benchmarking.sweep",
    "check_stability": "memfit.check.stability",
    "checkpoint": "memfit.checkpointing",
    "find_blocks": "memfit.checkpointing",
    "uncheckpoint": "memfit.checkpointing",
    "InfeasibleBudget": "memfit.errors",
    "MemfitError": "memfit.errors",
    "NonFiniteLoss": "memfit.errors",
    "prepare": "memfit.loop",
    "train_step": "memfit.loop",
    "estimate": "memfit.measuring.estimate",
    "measure": "memfit.measuring.memory",
    "profile": "memfit.measuring.profile",
    "plan": "memfit.planning.planner",
    "Precision": "memfit.precision",
    "Plan": "memfit.records",
    "Trainer": "memfit.trainer.trainer",
}


def __getattr__(name: str) -> Any:
    """A top-level name, imported from its module on first use (See Note [the lazy top level])."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
