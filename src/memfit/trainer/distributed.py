"""Multi-process training under ``torchrun``: DDP or FSDP2, with PyTorch's own wrappers.

memfit adds no distributed layer of its own: ``ddp`` wraps the model in
``torch.nn.parallel.DistributedDataParallel``; ``fsdp2`` calls
``torch.distributed.fsdp.fully_shard`` on every block (the blocks memfit finds and
checkpoints), then on the root. Each rank takes its slice of the global batch (every rank
draws the same global batch from the same seed), so a run on N processes computes the same
losses as one process with the same global batch. Training state is saved by rank 0 for
DDP (all ranks hold the same weights) and with ``torch.distributed.checkpoint`` by every
rank for FSDP2 (each holds a shard).

Trade-off: FSDP2 divides parameters, gradients and optimizer state by the world size but
all-gathers each block's parameters while it computes, one collective per block and
direction; DDP keeps everything whole and all-reduces the gradients once per step.

Example (2 processes on a CPU):
    ``python -m torch.distributed.run --nproc_per_node=2 -m memfit train run.toml
    --set train.distributed='"fsdp2"'``
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from memfit.devices import model_device
from memfit.errors import ConfigError
from memfit.step import Batch
from memfit.vocab import DISTRIBUTED_MODES, DistributedMode

__all__ = [
    "DistContext",
    "end_worker_process",
    "global_max",
    "global_mean",
    "init_distributed",
    "local_batch",
    "shutdown_distributed",
    "wrap_model",
]


@dataclass
class DistContext:
    """Where this process stands in the run."""

    mode: DistributedMode = "none"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False
    """This run created the process group, so it destroys it when it ends."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the only one that prints and writes reports."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """A process group is in use."""
        return self.mode != "none"


def init_distributed(mode: DistributedMode, device: torch.device) -> tuple[DistContext, torch.device]:
    """Join the process group ``torchrun`` set up (gloo on a CPU, NCCL on GPUs).

    Args:
        mode: ``"none"``, ``"ddp"`` or ``"fsdp2"``.
        device: the device asked for; on CUDA each rank takes ``cuda:LOCAL_RANK``.

    Returns:
        The context and the device this rank trains on.

    Raises:
        ConfigError: an unknown mode, or ddp/fsdp2 outside ``torchrun``.
    """
    if mode not in DISTRIBUTED_MODES:
        raise ConfigError(f"train.distributed {mode!r} is not one of {', '.join(DISTRIBUTED_MODES)}.")
    if mode == "none":
        return DistContext(), device
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError(
            f'train.distributed = "{mode}" needs several processes: start it with '
            "python -m torch.distributed.run --nproc_per_node=N -m memfit train CONFIG.toml."
        )
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    ctx = DistContext(mode, dist.get_rank(), dist.get_world_size(), local, owns_group=owns)
    return ctx, device


def shutdown_distributed(ctx: DistContext, finished: bool) -> None:
    """Leave the process group the run created: every rank waits for the others, then it is destroyed."""
    # Note [an orderly exit from the group]
    # A process that exits with its gloo group alive can abort in the group's destructor
    # ("terminate called without an active exception") while another rank still writes;
    # waiting at a barrier and destroying the group first makes the exit orderly. After a
    # failure there is no barrier: the other ranks may never reach it.
    if not (ctx.owns_group and dist.is_initialized()):
        return
    if finished:
        dist.barrier()
    dist.destroy_process_group()


def local_batch(batch: Batch, ctx: DistContext) -> Batch:
    """This rank's rows of the global batch (equal slices; the batch must divide evenly)."""
    if not ctx.active or ctx.world_size == 1:
        return batch
    tensors = [batch] if isinstance(batch, torch.Tensor) else list(batch)
    rows = int(tensors[0].shape[0])
    if rows % ctx.world_size:
        raise ConfigError(
            f"the batch of {rows} does not split evenly over {ctx.world_size} processes; "
            "make train.batch_size a multiple of the number of processes."
        )
    n = rows // ctx.world_size
    parts = [t[ctx.rank * n : (ctx.rank + 1) * n] for t in tensors]
    return parts[0] if isinstance(batch, torch.Tensor) else type(batch)(parts)


def global_mean(value: float, ctx: DistContext) -> float:
    """The mean of ``value`` over all ranks (the value itself without a process group)."""
    if not ctx.active:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return float(t.item()) / ctx.world_size


def global_max(value: int, ctx: DistContext) -> int:
    """The largest ``value`` over all ranks (the value itself without a process group)."""
    if not ctx.active:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def wrap_model(model: nn.Module, ctx: DistContext, blocks: list[str]) -> nn.Module:
    """Wrap ``model`` for ``ctx.mode``: DDP, or ``fully_shard`` per block then the root.

    Checkpointing is applied before wrapping (it wraps each block's forward, which
    ``fully_shard`` keeps), so the same plan works with and without sharding
    (See Note [wrap after checkpointing] in :mod:`memfit.app.setup`).
    """
    if ctx.mode == "ddp":
        device_ids = [ctx.local_rank] if model_device(model).type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    if ctx.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        if not blocks:
            raise ConfigError(
                f"FSDP2 shards per block, and {type(model).__name__} has no repeated blocks memfit "
                'can find; use train.distributed = "ddp".'
            )
        for name in blocks:
            fully_shard(model.get_submodule(name))
        fully_shard(model)
    return model


def end_worker_process(code: int) -> NoReturn:
    """End a ``torchrun`` worker whose run finished: flush, then exit past the interpreter's teardown."""
    # Measured on this machine (torch 2.13 CPU, gloo, two workers): about one run in eight, a
    # worker of rank 1 aborted after its run had finished and its process group was destroyed
    # (See Note [an orderly exit from the group]), with "terminate called without an active
    # exception" and, by faulthandler, no Python frame left: a C++ thread torn down at
    # interpreter exit. The elastic agent then reports the whole run failed. Every file is
    # written and closed by now (states atomically, the metrics log flushed per line and
    # closed), so skipping that teardown loses nothing.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
