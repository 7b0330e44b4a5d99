"""The per-rank memory of FSDP2 (and DDP) training, as a Profile the simulator and solver already read.

A profile is measured on one process, unsharded, at the batch one rank computes. FSDP2
(``fully_shard`` per block, then the root) changes what each rank holds:

- parameters, gradients and optimizer state are sharded: each rank keeps ``1/world_size``
  of every tensor (rounded up: the first dimension is padded to a multiple of the world);
- while a block computes, its parameters are all-gathered whole: the all-gather buffer and
  the unsharded parameters copied out of it, during its forward and its backward (where
  the next block's all-gather is already prefetched);
- a block's backward makes its gradients whole first, then reduce-scatters them (a
  buffer of the same size) and keeps only the shard;
- the root (embeddings, final norm, head) is not resharded after the forward: its whole
  parameters, and its whole gradients until the root's reduce-scatter at the very end,
  stay for the step.

:func:`shard_profile` writes those rules into the profile's numbers, so
:func:`memfit.stepmodel.simulate` predicts the per-rank peak and the solver plans
against a per-rank budget without knowing about FSDP.

DDP (:func:`replicate_profile`) keeps the whole model on every rank and copies the
gradients into buckets for the all-reduce: as many bytes as the gradients, allocated once
and held for the whole step.

Trade-off: the FSDP2 rules are an upper bound (they assume the prefetch and both all-gather
buffers overlap at the worst moment); the prediction errs on the safe side by about one
block's parameters.

Example:
    >>> from memfit.records import BlockStats, Profile
    >>> blk = BlockStats("b0", param_bytes=400, grad_bytes=400, saved_bytes={"none": 100},
    ...                  backward_peak_bytes={"none": 450})
    >>> prof = Profile(precision="fp32", device="cpu", batch_size=2, blocks=[blk],
    ...                outside=BlockStats("outside", param_bytes=100), param_bytes=500,
    ...                grad_bytes=500, optimizer_bytes=1000, optimizer_temp_bytes=0)
    >>> shard_profile(prof, 2).optimizer_bytes
    500
"""

from __future__ import annotations

import copy
import dataclasses
import math

from memfit.errors import ConfigError
from memfit.records import Profile
from memfit.vocab import DistributedMode

__all__ = ["rank_profile", "replicate_profile", "shard_profile"]


def _shard(n: int, world: int) -> int:
    return math.ceil(n / world)


def shard_profile(profile: Profile, world_size: int) -> Profile:
    """``profile`` (one process, the per-rank batch) as one rank of FSDP2 over ``world_size``.

    Args:
        profile: measured unsharded at the batch size one rank computes.
        world_size: number of processes sharding the model.

    Returns:
        A new Profile whose simulated peak is the per-rank peak under FSDP2.
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be at least 1, got {world_size}.")
    if world_size == 1:
        return copy.deepcopy(profile)
    out = copy.deepcopy(profile)
    w = world_size
    blocks_params = sum(b.param_bytes for b in profile.blocks)
    root_params = max(0, profile.param_bytes - blocks_params)
    # Held all step: every shard, plus the root's whole parameters (not resharded).
    out.param_bytes = _shard(profile.param_bytes, w) + root_params
    out.optimizer_bytes = _shard(profile.optimizer_bytes, w)
    out.optimizer_temp_bytes = _shard(profile.optimizer_temp_bytes, w)
    # The root's gradients stay whole until its reduce-scatter at the end of the backward.
    out.early_grad_bytes = profile.early_grad_bytes
    out.grad_bytes = _shard(profile.grad_bytes, w)
    previous = 0
    for block, new in zip(profile.blocks, out.blocks, strict=True):
        p = block.param_bytes
        g = block.grad_bytes or p
        # Forward: all-gather buffer + the unsharded parameters copied out of it.
        new.forward_peak_bytes = {
            m: block.forward_peak_bytes.get(m, block.saved_bytes[m]) + 2 * p for m in block.saved_bytes
        }
        # Backward: this block gathered (2p), the next one in backward order prefetched
        # (the block before it in forward order), the reduce-scatter input (g) on top of
        # the whole gradients already counted in the measured backward peak.
        added = 2 * p + previous + g
        new.backward_peak_bytes = {m: v + added for m, v in block.backward_peak_bytes.items()}
        new.grad_bytes = _shard(g, w)
        # None of this shrinks with micro-batches: the gathered parameters, and the block's
        # whole gradients (measured in its backward peak; only the shard is kept).
        new.forward_fixed_bytes = block.forward_fixed_bytes + 2 * p
        new.backward_fixed_bytes = block.backward_fixed_bytes + added + g - new.grad_bytes
        new.param_bytes = _shard(p, w)
        previous = p
    # A segment recomputes several FSDP2 units in one backward step, gathering all their
    # parameters at once; the rules above do not model that, so sharded plans use none.
    note = f"FSDP2 over {w} processes: per-rank memory (memfit.planning.sharding)"
    return dataclasses.replace(out, chain_links=[], notes=[*profile.notes, note])


def replicate_profile(profile: Profile) -> Profile:
    """``profile`` (one process, the per-rank batch) as one rank of DDP: plus its gradient buckets.

    Example:
        >>> from memfit.records import BlockStats, Profile
        >>> prof = Profile(precision="fp32", device="cpu", batch_size=2, blocks=[],
        ...                outside=BlockStats("outside"), param_bytes=500, grad_bytes=500,
        ...                optimizer_bytes=1000, optimizer_temp_bytes=0)
        >>> replicate_profile(prof).param_bytes
        1000
    """
    out = copy.deepcopy(profile)
    # DistributedDataParallel's reducer buckets (gradient_as_bucket_view=False, the default)
    # are a copy of every gradient, alive from construction on: held like parameters.
    out.param_bytes = profile.param_bytes + profile.grad_bytes
    note = "DDP: gradient buckets held all step (memfit.planning.sharding)"
    return dataclasses.replace(out, notes=[*profile.notes, note])


def rank_profile(profile: Profile, mode: DistributedMode, world_size: int) -> Profile:
    """One rank's profile for ``mode``: ``"ddp"`` (:func:`replicate_profile`), ``"fsdp2"``
    (:func:`shard_profile`) or ``"none"`` (the profile itself)."""
    if mode == "ddp":
        return replicate_profile(profile)
    if mode == "fsdp2":
        return shard_profile(profile, world_size)
    if mode == "none":
        return copy.deepcopy(profile)
    raise ConfigError(f"cannot plan for distributed mode {mode!r}; use none, ddp or fsdp2.")
