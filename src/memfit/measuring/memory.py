"""Peak memory of one steady-state training step, from PyTorch's own tracking.

On a CPU (and under fake tensors) the tracker is
``torch.distributed._tools.mem_tracker.MemTracker``; on a GPU the peak comes from the CUDA
caching allocator's statistics and MemTracker supplies the breakdown. Both count exact
bytes, so the same step measured twice gives the same number.

Example:
    >>> import torch
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> x = torch.randint(0, 256, (2, 16))
    >>> report = measure(model, (x, x), gpt_loss, opt, steps=1)
    >>> report.peak_bytes == sum(report.breakdown.values())
    True
"""

from __future__ import annotations

import functools
import statistics

import torch
from torch import nn

from memfit.devices import model_device, seconds_of
from memfit.measuring.preserve import preserved
from memfit.measuring.tracker import MemoryWatch
from memfit.precision import Precision, as_precision
from memfit.records import MemoryReport
from memfit.step import Batch, LossFn, training_step
from memfit.vocab import PrecisionChoice

__all__ = ["measure", "tracked_step"]


def tracked_step(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision,
    micro_batches: int = 1,
) -> tuple[int, dict[str, int], int]:
    """Run one step under MemTracker; return (peak, breakdown at the peak, activation bytes).

    Activation bytes are what is held, beyond parameters and optimizer state, when the
    first micro-batch's loss is ready: what the forward pass keeps for backward.
    """
    after: list[dict[str, int]] = []
    with MemoryWatch(model, optimizer) as watch:
        training_step(
            model,
            batch,
            loss_fn,
            optimizer,
            precision,
            micro_batches,
            after_forward=lambda: after.append(watch.current()),
        )
    acts = after[0]["activations"] + after[0]["temporaries"] if after else 0
    return watch.peak_bytes, watch.breakdown, acts


def measure(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None = None,
    precision: PrecisionChoice | str | Precision = "fp32",
    steps: int = 3,
    micro_batches: int = 1,
) -> MemoryReport:
    """Measure the peak bytes and step time of one steady-state training step.

    A warm-up step creates the optimizer state first, so the measured step is what every
    later step of training costs. Model weights, buffers, gradients, optimizer state and
    the RNG are restored afterwards: measuring changes nothing.

    Args:
        model: the model, already on its device (checkpointed or not).
        batch: a tensor or tuple of tensors whose first dimension is the batch.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        optimizer: its step and state are part of the step; None measures forward and
            backward only.
        precision: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"auto"`` or a Precision.
        steps: timed steps after the tracked one; the median is reported.
        micro_batches: split the batch into this many parts with gradient accumulation.

    Returns:
        A :class:`MemoryReport`; ``breakdown`` adds up to ``peak_bytes``.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}.")
    device = model_device(model)
    prec = as_precision(precision, device=device)
    scaler_state = prec.scaler.state_dict()
    with preserved(model, optimizer):
        model.train()
        training_step(model, batch, loss_fn, optimizer, prec, micro_batches)
        peak, breakdown, acts = tracked_step(model, batch, loss_fn, optimizer, prec, micro_batches)
        times = []
        for _ in range(steps):
            step = functools.partial(training_step, model, batch, loss_fn, optimizer, prec, micro_batches)
            times.append(seconds_of(step, device))
        if scaler_state:
            prec.scaler.load_state_dict(scaler_state)
    return MemoryReport(
        peak_bytes=int(peak),
        breakdown={k: int(v) for k, v in breakdown.items()},
        activation_bytes=int(acts),
        step_seconds=statistics.median(times),
        device=str(device),
        precision=prec.mode,
        tracker="MemTracker" if device.type != "cuda" else "cuda-allocator",
    )
