"""Every checkpointing mode's memory of one step under fake tensors: :func:`memory_profile`.

What the largest-batch search (:mod:`memfit.planning.largest_batch`) probes each batch size
with: nothing is allocated and nothing timed, so a batch far larger than the device holds
costs a fraction of a step and no memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from memfit.devices import model_device
from memfit.measuring.preserve import create_optimizer_state, preserved
from memfit.measuring.profile import Profiler, profile
from memfit.precision import Precision, as_precision
from memfit.records import Profile
from memfit.step import Batch, LossFn
from memfit.vocab import CHECKPOINT_MODES, PrecisionChoice

__all__ = ["memory_profile"]


def memory_profile(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None = None,
    precision: PrecisionChoice | str | Precision = "fp32",
    blocks: Sequence[str] | None = None,
) -> Profile:
    """Every checkpointing mode's memory, measured under fake tensors: nothing is allocated,
    nothing timed (the profile has no time model).

    What the largest-batch search probes with. Where the model cannot run on a fake twin
    (a forward that reads values), it is :func:`profile` with one timed step, which runs
    real steps only where they fit (a step that runs out of memory raises
    :class:`memfit.errors.OutOfMemory`).

    Example:
        >>> import torch
        >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
        >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
        >>> x = torch.randint(0, 256, (2, 16))
        >>> fake = memory_profile(model, (x, x), gpt_loss)
        >>> real = profile(model, (x, x), gpt_loss, repeats=1)
        >>> fake.memory_from, fake.measured_peak_bytes == real.measured_peak_bytes
        ('fake tensors', True)
    """
    prec = as_precision(precision, device=model_device(model))
    with preserved(model, optimizer):
        prof = Profiler(model, batch, loss_fn, optimizer, prec, blocks)
        create_optimizer_state(model, optimizer)
        if prof.estimated_peak() is not None:
            prof.use_estimate()
            prof.modes([m for m in CHECKPOINT_MODES if m != "none"] if prof.blocks else [])
            return prof.result()
    return profile(model, batch, loss_fn, optimizer, prec, repeats=1, blocks=blocks)
