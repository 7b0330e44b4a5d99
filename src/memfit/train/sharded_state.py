"""FSDP2 training state: each rank's shards via ``torch.distributed.checkpoint`` (DCP).

``state.pt`` (written by rank 0 with :func:`memfit.train.state.save_state`) holds what every
rank shares: step, RNG, scaler, schedule, data position; ``state.dcp/`` holds the model and
optimizer shards, written by all ranks together. The pair rotates as one: the directory is
written as ``state.dcp.tmp`` and renamed only when every rank has finished, then the old
pair becomes ``state.prev.pt`` / ``state.prev.dcp``.

Trade-off: DCP writes one file per rank and needs every rank to save and load together,
but no rank ever gathers the whole model, so a model too big for one device saves fine;
DCP can also reshard when resuming on a different number of processes.

Example (inside a ``torchrun`` process with an FSDP2 model ``m`` and optimizer ``o``):
    ``save_sharded(m, o, Path("out/state.pt"), {"step": 3}, rank == 0)`` and later
    ``load_sharded(m, o, Path("out/state.pt"))``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memfit.train.state import save_state

__all__ = ["load_sharded", "save_sharded", "sharded", "shards_path"]


def sharded(model: nn.Module) -> bool:
    """Whether ``model`` was sharded with FSDP2's ``fully_shard`` (its state goes to DCP)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


def shards_path(path: str | os.PathLike[str]) -> Path:
    """The DCP directory that goes with a state file: ``state.pt`` -> ``state.dcp``."""
    return Path(path).with_suffix(".dcp")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_sharded(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: str | os.PathLike[str],
    state: dict[str, Any],
    is_main: bool,
) -> Path:
    """Save model and optimizer shards with DCP and, on rank 0, ``state`` to ``path``.

    Every rank must call it at the same step.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    target = shards_path(path)
    tmp = target.with_name(target.name + ".tmp")
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
    _barrier()
    if is_main:
        prev = shards_path(path.with_name(f"{path.stem}.prev{path.suffix}"))
        if target.exists():
            shutil.rmtree(prev, ignore_errors=True)
            os.replace(target, prev)
        os.replace(tmp, target)
        save_state({**state, "sharded": True}, path)
    _barrier()
    return path


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike[str]) -> None:
    """Load this rank's model and optimizer shards saved by :func:`save_sharded` next to ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from memfit.errors import StateError

    target = shards_path(path)
    if not target.is_dir():
        raise StateError(f"{str(path)!r} is an FSDP2 state but its shards {str(target)!r} are missing.")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # NOTE: DCP loads in place into the tensors of these dicts.
    dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(target))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
