"""PyTorch's own ways to train a step in less memory, as ``bench_pytorch_planners.py`` runs them.

- :func:`full_every_block` / :func:`sac_every_block`: ``torch.utils.checkpoint`` on every block,
  plain or with PyTorch's selective activation checkpointing (``create_selective_checkpoint_contexts``
  with the policy torchtitan uses: keep the outputs of matmuls, convolutions and attention,
  recompute the rest);
- :func:`compiled` and :func:`compile_budget`: ``torch.compile`` with
  ``torch._functorch.config.activation_memory_budget``;
- :func:`sac_milp_policy`: ``torch.distributed._tools``' SAC estimator and MILP (``sac_milp``, then
  ``get_optimal_checkpointing_policy_per_module`` per module it checkpoints), measured under
  fake tensors; needs PuLP (``pip install pulp``) and, on a CPU, a timing function that does
  not use CUDA events (:func:`cpu_timing`);
- :func:`rss_peak`: the peak bytes of a step as the process's resident set grows (``VmHWM``,
  reset before the step): what a compiled step allocates, which MemTracker cannot see inside
  inductor's code. glibc is told to map each allocation of 64 KiB or more on its own first
  (:func:`memfit.devices.return_freed_address_space`), so freed tensors leave the resident set.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = [
    "compile_budget",
    "compiled",
    "cpu_timing",
    "full_every_block",
    "rss_peak",
    "sac_every_block",
    "sac_milp_policy",
]

_aten = torch.ops.aten
#: What torchtitan's selective AC keeps: the outputs of matmuls, convolutions and attention.
KEEP = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.convolution.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _wrap(module: nn.Module, context_fn: Callable[[], Any] | None) -> None:
    """Replace ``module.forward`` by one through ``torch.utils.checkpoint`` (non-reentrant)."""
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if context_fn is None:
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


def _blocks(model: nn.Module, block_class: type[nn.Module]) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, block_class)]


def _cache_off(model: nn.Module) -> nn.Module:
    """``model`` with a Hugging Face config's ``use_cache`` off, as Hugging Face's own gradient
    checkpointing does (with it on, a decoder layer's recompute extends a cache its forward
    already extended: selective checkpointing then finds ops its forward did not run)."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # type: ignore[union-attr]
    return model


def full_every_block(model: nn.Module, block_class: type[nn.Module]) -> nn.Module:
    """A copy of ``model`` with ``torch.utils.checkpoint`` on every block."""
    model = _cache_off(copy.deepcopy(model))
    for block in _blocks(model, block_class):
        _wrap(block, None)
    return model


def _keep_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def sac_every_block(model: nn.Module, block_class: type[nn.Module]) -> nn.Module:
    """A copy of ``model`` with PyTorch's selective activation checkpointing on every block."""
    model = _cache_off(copy.deepcopy(model))
    context = functools.partial(create_selective_checkpoint_contexts, _keep_policy)
    for block in _blocks(model, block_class):
        _wrap(block, context)
    return model


def compiled(model: nn.Module, budget: float = 1.0) -> nn.Module:
    """A copy of ``model`` under ``torch.compile`` (Inductor), its graph partitioned with
    ``torch._functorch.config.activation_memory_budget`` = ``budget``; it compiles on its
    first call.

    Each budget gets a backend of its own: dynamo keeps compiled graphs on the forward's code
    object, and a second copy of the same model passes the first one's guards (nn modules are
    inlined, their parameters inputs), so it would run the first one's graph, partitioned
    under that budget. A different backend callable fails dynamo's backend match, so each
    copy compiles, and its backend sets the budget while it partitions.
    """
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
        with compile_budget(budget):
            return compile_fx(gm, example_inputs)  # type: ignore[no-any-return]

    return torch.compile(copy.deepcopy(model), backend=backend)  # type: ignore[return-value]


@contextlib.contextmanager
def compile_budget(budget: float) -> Iterator[None]:
    """``torch._functorch.config.activation_memory_budget`` = ``budget`` while inside."""
    import torch._functorch.config as functorch_config

    with functorch_config.patch(activation_memory_budget=budget):
        yield


def _status(key: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def rss_peak(step: Callable[[], object]) -> int:
    """How far the resident set grew above where it was while ``step`` ran (Linux)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
        f.write("5")  # resets VmHWM to the resident set now
    start = _status("VmRSS")
    step()
    return _status("VmHWM") - start


class _CpuEvent:
    """What ``RuntimeEstimator`` needs of ``torch.cuda.Event``, timed by ``perf_counter``."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.at = 0.0

    def record(self, stream: object = None) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: _CpuEvent) -> float:
        return (end.at - self.at) * 1e3


@contextlib.contextmanager
def cpu_timing() -> Iterator[None]:
    """Let ``RuntimeEstimator``'s benchmark mode (and so ``SACEstimator``'s) time ops on a CPU:
    its events, stream and synchronize become ``perf_counter`` ones (torch 2.13 takes them from
    ``torch.cuda``, 2.14 from ``torch.Event`` and ``torch.accelerator``)."""
    from unittest import mock

    def nothing(*args: object, **kwargs: object) -> None:
        return None

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.Event", _CpuEvent))
        stack.enter_context(mock.patch("torch.Event", _CpuEvent))
        for name in ("torch.cuda.current_stream", "torch.cuda.synchronize"):
            stack.enter_context(mock.patch(name, nothing))
        if hasattr(torch, "accelerator"):
            for name in ("torch.accelerator.current_stream", "torch.accelerator.synchronize"):
                stack.enter_context(mock.patch(name, nothing))
        yield


def _policy(table: dict[tuple[str, int], bool]) -> Callable[..., CheckpointPolicy]:
    """A per-op policy from ``(op name, its occurrence in the module's forward) -> keep`` (the
    estimator's order); ops it did not list are recomputed. One per checkpointed call: the
    forward and its recompute count their occurrences apart."""
    seen: Counter[tuple[str, bool]] = Counter()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = op._overloadpacket.__name__ if hasattr(op, "_overloadpacket") else str(op)
        count = seen[(name, ctx.is_recompute)]
        seen[(name, ctx.is_recompute)] += 1
        keep = table.get((name, count), False)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _contexts(table: dict[tuple[str, int], bool]) -> Any:
    return create_selective_checkpoint_contexts(_policy(table))


def sac_milp_policy(
    make: Callable[[], tuple[nn.Module, Any, Callable[..., torch.Tensor], torch.optim.Optimizer]],
    budget_bytes: int,
) -> tuple[dict[str, float], int, Callable[[nn.Module], nn.Module]]:
    """PyTorch's SAC estimator + MILP for ``budget_bytes``: its decisions (module -> share of
    activation memory to discard), its predicted peak (-1: no solution) and a function that
    applies them to a model (a copy, each module checkpointed with its per-op policy).

    ``make`` builds the model, batch, loss function and optimizer; it is called under
    ``FakeTensorMode`` (the estimators' setting).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module, sac_milp

    with FakeTensorMode(), cpu_timing():
        model, batch, loss_fn, opt = make()
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad()
        runtime = RuntimeEstimator()
        with runtime("operator-level-benchmark"):
            loss_fn(model, batch).backward()
        sac = SACEstimator()
        with sac("operator-level-benchmark"):
            loss_fn(model, batch)
        info = aggregate_stats(model, tracker, runtime, sac, torch.device("cpu"))
    graph = parse_module_info(info)
    decisions, _, peak = sac_milp(graph, memory_budget=budget_bytes / 2**30)
    per_op = {
        fqn: get_optimal_checkpointing_policy_per_module(sac.sac_mod_stats[fqn], memory_budget=1 - ratio)
        for fqn, ratio in decisions.items()
        if ratio > 0
    }

    def apply(real: nn.Module) -> nn.Module:
        real = _cache_off(copy.deepcopy(real))
        for fqn, keep in per_op.items():
            names = sac.sac_mod_stats[fqn].func_names
            seen: Counter[str] = Counter()
            table = {}
            for name, k in zip(names, keep, strict=True):
                table[(name, seen[name])] = bool(k)
                seen[name] += 1
            module = real.get_submodule(fqn.split(".", 1)[1] if "." in fqn else "")  # "GPT.blocks.0"
            _wrap(module, functools.partial(_contexts, table))
        return real

    return decisions, int(peak), apply
