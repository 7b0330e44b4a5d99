"""Peak memory of one steady-state training step, from PyTorch's own tracking.

On a CPU (and under fake tensors) the tracker is
``torch.distributed._tools.mem_tracker.MemTracker``; on a GPU the peak comes from the CUDA
caching allocator's statistics and MemTracker supplies the breakdown. Both count exact
bytes, so the same step measured twice gives the same number.

Example:
    >>> import torch
    >>> from memfit.train.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> x = torch.randint(0, 256, (2, 16))
    >>> report = measure(model, (x, x), gpt_loss, opt, steps=1)
    >>> report.peak_bytes == sum(report.breakdown.values())
    True
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

from memfit.measure.state import preserved
from memfit.precision import Precision, as_precision
from memfit.records import MemoryReport
from memfit.step import Batch, LossFn, training_step

__all__ = ["FastMemTracker", "MemoryWatch", "ignore_frozen_parameters", "measure", "tracked_step"]


def _parts(snapshot: dict[Any, int]) -> dict[str, int]:
    """Map MemTracker's categories onto memfit's breakdown keys."""
    get = snapshot.get
    return {
        "params": get(_MemRefType.PARAM, 0) + get(_MemRefType.BUFFER, 0),
        "grads": get(_MemRefType.GRAD, 0),
        "optimizer": get(_MemRefType.OPT, 0),
        "activations": get(_MemRefType.ACT, 0),
        "temporaries": get(_MemRefType.TEMP, 0) + get(_MemRefType.OTH, 0),
    }


def _fsdp_parts(snapshot: dict[Any, int]) -> dict[str, int]:
    """Map FSDPMemTracker's categories (sharded, unsharded, collectives) onto the breakdown."""
    by = {getattr(k, "name", str(k)): v for k, v in snapshot.items()}
    get = by.get
    return {
        "params": get("SHARDED_PARAM", 0)
        + get("UNSHARDED_PARAM", 0)
        + get("BUFFER", 0)
        + get("ALL_GATHER", 0),
        "grads": get("SHARDED_GRAD", 0) + get("UNSHARDED_GRAD", 0) + get("REDUCE_SCATTER", 0),
        "optimizer": get("OPT", 0),
        "activations": get("ACT", 0) + get("INP", 0),
        "temporaries": get("TEMP", 0) + get("OTH", 0),
    }


def _is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


class FastMemTracker(MemTracker):
    """MemTracker with the same numbers and a peak update that visits only the running modules.

    # NOTE: MemTracker's own peak update visits every module it has ever seen, for every op:
    # quadratic in model size (seconds per step on a model of a few hundred modules). This
    # one looks the running modules up by name; the updates are the same. A snapshot is a
    # flat {category: bytes} dict, so a plain copy does what deepcopy did.
    """

    def __init__(self) -> None:
        super().__init__()
        self._stats_by_fqn: dict[str, Any] = {}

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        super()._pre_fw_hook(module, inputs)
        stats = self.memory_tracking[module]
        self._stats_by_fqn[stats.mod_fqn] = stats

    def _update_peak_stats(self, peak_state: Any) -> None:
        curr = self._curr_mem_snap
        for fqn in self._mod_tracker.parents:
            stats = self._stats_by_fqn.get(fqn)
            if stats is None or peak_state not in stats.snapshots:
                continue
            for dev, dev_snap in curr.items():
                if stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                    stats.snapshots[peak_state][-1][dev] = dict(dev_snap)
        for dev, dev_snap in curr.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(dev_snap)


class _NoHook:
    def remove(self) -> None:
        pass


def ignore_frozen_parameters(tracker: MemTracker, model: nn.Module) -> None:
    """Let ``tracker`` watch a model with frozen parameters (Whisper's position embeddings).

    # NOTE: MemTracker registers a gradient hook on every parameter of a module it enters,
    # and PyTorch refuses a hook on a tensor that does not require grad. Marking the frozen
    # ones as already hooked (with handles that remove nothing) skips them; they still
    # count as parameters, and they never get a gradient to count.
    """
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())


def _device_of(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


class MemoryWatch:
    """Context that tracks the memory of the training step run inside it.

    MemTracker gives the breakdown on every device; on a GPU the CUDA allocator's peak is
    the total. Tracking only observes: the step computes exactly what it would untracked.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 4)
        >>> with MemoryWatch(model) as watch:
        ...     model(torch.randn(2, 4)).sum().backward()
        >>> watch.peak_bytes == sum(watch.breakdown.values()) > 0
        True
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self._hook: Any = None
        self.device = _device_of(model)
        self.peak_bytes = 0
        self.breakdown: dict[str, int] = {}
        self._parts = _parts
        if _is_fsdp(model):
            # NOTE: an FSDP2 model's parameters are DTensors; FSDPMemTracker counts this rank's
            # shards plus the unsharded parameters and gradients of the block computing.
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            self._tracker: MemTracker = FSDPMemTracker(model, optimizer)
            self._parts = _fsdp_parts
        else:
            self._tracker = FastMemTracker()
            modules: list[Any] = [model] + ([optimizer] if optimizer is not None else [])
            self._tracker.track_external(*modules)
            ignore_frozen_parameters(self._tracker, model)

    def current(self) -> dict[str, int]:
        """The breakdown of what is held now (call inside the context)."""
        return self._parts(self._tracker.get_tracker_snapshot("current").get(self.device, {}))

    def __enter__(self) -> MemoryWatch:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        # NOTE: registered before MemTracker's own global hooks so it runs first.
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._next_micro_batch)
        self._tracker.__enter__()
        return self

    def _next_micro_batch(self, module: nn.Module, args: Any) -> None:
        # NOTE: MemTracker refuses a second forward of the root module in one context (it
        # takes it for a new iteration). With gradient accumulation that second forward is
        # the next micro-batch of the same step: clear the per-module statistics (the
        # peak snapshot is kept) so it is tracked like the first.
        tracker = self._tracker
        if module is self.model and module in tracker.memory_tracking and not tracker._mod_tracker.is_bw:
            tracker.reset_mod_stats()

    def __exit__(self, *exc: object) -> None:
        self._tracker.__exit__(*exc)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.breakdown = self._parts(self._tracker.get_tracker_snapshot("peak").get(self.device, {}))
        self.peak_bytes = sum(self.breakdown.values())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # NOTE: on a GPU the allocator's peak is the truth: it also counts what MemTracker
            # does not see (the batch, cuBLAS workspaces); the difference goes to temporaries.
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            self.breakdown["temporaries"] += self.peak_bytes - sum(self.breakdown.values())


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
    precision: str | Precision = "fp32",
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
    device = _device_of(model)
    prec = as_precision(precision, device=device)
    scaler_state = prec.scaler.state_dict()
    with preserved(model, optimizer):
        model.train()
        training_step(model, batch, loss_fn, optimizer, prec, micro_batches)
        peak, breakdown, acts = tracked_step(model, batch, loss_fn, optimizer, prec, micro_batches)
        times = []
        for _ in range(steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            training_step(model, batch, loss_fn, optimizer, prec, micro_batches)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
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
