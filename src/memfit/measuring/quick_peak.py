"""The plain step's peak from a step that runs only the distinct blocks: :func:`quick_peak`.

Where the room is unknown and fake tensors give no estimate, a fraction budget that no plan
can meet (under the weights, gradients and optimizer state) is refused on this estimate
before a whole tracked step runs (:mod:`memfit.planning.measure`).

Example:
    >>> import torch
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> from memfit.measuring.profile import Profiler
    >>> from memfit.precision import Precision
    >>> import memfit
    >>> model = GPT(GPTConfig(n_layer=6, n_embd=32, n_head=2, block_size=16))
    >>> x = torch.randint(0, 256, (2, 16))
    >>> quick = quick_peak(Profiler(model, (x, x), gpt_loss, None, Precision("fp32")))
    >>> quick == memfit.measure(model, (x, x), gpt_loss, None, "fp32", steps=1).peak_bytes
    True
"""

from __future__ import annotations

import time

from memfit.checkpointing import uncheckpoint
from memfit.checkpointing.segments import chain_probe
from memfit.measuring.batchcheck import batch_errors
from memfit.measuring.depth import every_layer_runs
from memfit.measuring.phases import grad_bytes_of, phased_step, profile_from_memory
from memfit.measuring.preserve import create_optimizer_state
from memfit.measuring.profile import Profiler
from memfit.measuring.repeated_blocks import skipping, stand_ins
from memfit.step import batch_size
from memfit.stepmodel import simulate

__all__ = ["quick_peak"]


def quick_peak(p: Profiler) -> int | None:
    """The no-checkpointing peak of ``p``'s step from one tracked step that runs only the
    distinct blocks (the others pass their input through): an estimate.

    Worth it where most blocks are identical (two thirds or more would pass through); None
    otherwise, or when a block that ran is not residual after all. What ran is added to
    ``p.measured``.
    """
    if not p.blocks:
        return None
    skipped = stand_ins(p.model, p.blocks, [True] * len(p.blocks))
    if 3 * len(skipped) < 2 * len(p.blocks):
        return None
    create_optimizer_state(p.model, p.optimizer)
    uncheckpoint(p.model)
    active = [b for b in p.blocks if b not in skipped]
    started = time.perf_counter()
    with (
        p.phase(f"estimating the peak from {len(active)} blocks"),
        every_layer_runs(p.model),
        skipping(p.model, list(skipped)),
        batch_errors(p.model, p.batch),
        chain_probe(p.model, active) as probe,
    ):
        mem = phased_step(p.model, p.batch, p.loss_fn, p.optimizer, p.precision, active)
    p.measured.append(
        f"1 tracked step at {p.precision.mode} of {len(active)} of {len(p.blocks)} blocks, to "
        f"estimate the peak ({time.perf_counter() - started:.2f} s)"
    )
    if not all(probe.keeps_shape):
        return None
    rows = batch_size(p.batch)
    prof = profile_from_memory(p.model, p.blocks, {"none": mem}, p.precision.mode, rows, skipped)
    prof.grad_bytes = grad_bytes_of(p.model)
    return simulate(prof, "none").peak_bytes
