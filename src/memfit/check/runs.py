"""The training runs of a stability check: one model, one precision, identical batches.

:class:`CheckRunner` builds a fresh model for every run (verifying that ``model_fn`` builds
identical initial weights each time), trains it with :func:`memfit.step.training_step` for
the given batch order, watches it with :class:`~memfit.check.attribution.OverflowWatch`
(mixed-precision runs only) and evaluates the final weights in fp32.

Trade-off: every run rebuilds the model and its optimizer, which costs a little time but
guarantees that no state leaks from one run to the next.

Example:
    >>> import torch
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> def model_fn():
    ...     return GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8))
    >>> batches = [(torch.randint(0, 256, (2, 8)),) * 2]
    >>> runner = CheckRunner(model_fn, batches, gpt_loss, lambda ps: torch.optim.SGD(ps, lr=0.1),
    ...                      torch.device("cpu"), seed=0, clip_norm=None)
    >>> len(runner.run("fp32", "fp32", [0, 0], 0, batches).curve.losses)
    2
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from memfit.applying import apply, remove_levers
from memfit.check.attribution import OverflowWatch, grad_underflow_fractions
from memfit.errors import ConfigError
from memfit.levers.frozen import frozen_params
from memfit.precision import Precision
from memfit.progress import phase
from memfit.records import ModuleRange, NonFinite, Plan, RunCurve
from memfit.step import Batch, LossFn, training_step
from memfit.vocab import PrecisionName, normalize_modes

__all__ = ["CheckRunner", "OptimizerFn", "RunResult", "finite", "flat_params"]

OptimizerFn = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class RunResult:
    """One run: its curve, final weights (flattened fp32), first non-finite value, fp16 ranges."""

    curve: RunCurve
    params: torch.Tensor
    first_nonfinite: NonFinite | None
    modules: list[ModuleRange]
    final_scale: float


def _to(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, tuple | list):
        return type(batch)(_to(t, device) for t in batch)
    return batch


def finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def flat_params(model: nn.Module) -> torch.Tensor:
    """The trained parameters of ``model`` as one fp32 vector (frozen ones never move)."""
    return torch.cat([p.detach().float().flatten().cpu() for p in model.parameters() if p.requires_grad])


def _same_weights(a: dict[str, torch.Tensor], model: nn.Module) -> str | None:
    """The first state_dict key whose value differs from ``a`` (None: identical)."""
    b = model.state_dict()
    if set(a) != set(b):
        return next(iter(sorted(set(a) ^ set(b))))
    for key, value in a.items():
        other = b[key].detach().cpu()
        if value.shape != other.shape or not torch.equal(value, other):
            return key
    return None


class CheckRunner:
    """The runs of one check (fp32, fp32 noise, each precision), sharing the inputs."""

    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        batches: Sequence[Batch],
        loss_fn: LossFn,
        optimizer_fn: OptimizerFn,
        device: torch.device,
        seed: int,
        clip_norm: float | None,
    ) -> None:
        self.model_fn, self.batches, self.loss_fn, self.optimizer_fn = (
            model_fn,
            batches,
            loss_fn,
            optimizer_fn,
        )
        self.device, self.seed, self.clip_norm = device, seed, clip_norm
        self.initial: dict[str, torch.Tensor] | None = None

    def build(self) -> nn.Module:
        torch.manual_seed(self.seed)
        model = self.model_fn()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model_fn returned {type(model).__name__}; it must return an nn.Module.")
        if self.initial is None:
            self.initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        elif (key := _same_weights(self.initial, model)) is not None:
            raise ConfigError(
                f"model_fn built a model whose initial weights differ from the first call's (at {key!r}), "
                "so the runs cannot be compared; make model_fn deterministic (seed it or load fixed weights)."
            )
        return model.to(self.device)

    def evaluate(self, model: nn.Module, eval_batches: Sequence[Batch]) -> float | None:
        was = model.training
        model.eval()
        with torch.no_grad():
            losses = [float(self.loss_fn(model, _to(b, self.device)).float()) for b in eval_batches]
        model.train(was)
        return finite(sum(losses) / len(losses))

    def run(
        self,
        name: str,
        mode: PrecisionName,
        order: Sequence[int],
        run_seed: int,
        eval_batches: Sequence[Batch],
        blocks: dict[str, str] | None = None,
        micro_batches: int = 1,
        skip: frozenset[int] = frozenset(),
        levers: Sequence[str] = (),
    ) -> RunResult:
        """One training run; ``skip`` names steps that update nothing (an fp16 run's skipped steps);
        ``blocks`` and ``levers`` (:mod:`memfit.applying`) are applied to its model and optimizer."""
        model = self.build()
        precision = Precision(mode, device=self.device)
        run = Plan(blocks=normalize_modes(blocks or {}), precision=mode, levers=list(levers))
        optimizer = apply(model, run, self.optimizer_fn(model.parameters())).optimizer
        assert optimizer is not None
        clip: float | None = self.clip_norm if self.clip_norm else math.inf  # inf: norms measured only
        if not self.clip_norm and "fused_step" in levers and "selective" in (blocks or {}).values():
            clip = None  # a fused step measures norms with a second backward, which SAC refuses
        curve = RunCurve(name=name, precision=mode)
        first: NonFinite | None = None
        torch.manual_seed(run_seed)
        start = time.perf_counter()
        model.train()
        watch = OverflowWatch(model)
        # the fp32 runs go unwatched (hooks cost up to half a step on small models);
        # a non-finite fp32 loss is reported without attribution.
        watched = watch if mode != "fp32" else contextlib.nullcontext()
        with watched, phase(f"training {name}", len(order)) as ph:
            for step, index in enumerate(order, start=1):
                watch.begin_step()
                r = training_step(
                    model,
                    _to(self.batches[index], self.device),
                    self.loss_fn,
                    None if step in skip else optimizer,
                    precision,
                    micro_batches=micro_batches,
                    clip_norm=clip,
                )
                found = watch.end_step(r.loss, step) if mode != "fp32" else None
                r.skipped = r.skipped or step in skip
                curve.losses.append(finite(r.loss))
                curve.grad_norms.append(finite(r.grad_norm))
                curve.scales.append(r.scale)
                curve.skipped.append(r.skipped)
                ph.advance()
                scaled = precision.scaler.is_enabled()
                if found is not None and first is None and not (scaled and found.phase == "backward"):
                    # With fp16, a non-finite *scaled gradient* is how GradScaler finds
                    # its scale; the step is skipped and nothing is lost. Forward and loss
                    # overflows are real: loss scaling cannot repair them.
                    first = found
                if not scaled and not math.isfinite(r.loss):
                    break  # without a scaler the weights are now lost; more steps add nothing
        curve.seconds = time.perf_counter() - start
        if "weights_bf16" in levers:
            # judged in fp32 like every run: the bf16 weights upcast (exactly) first
            remove_levers(model, optimizer)
            model.float()
        elif "frozen_bf16" in levers:
            for p in frozen_params(model):  # NF4 weights stay: they are what is judged
                p.data = p.data.float()
        curve.eval_loss = self.evaluate(model, eval_batches)
        modules: list[ModuleRange] = []
        scale = float(precision.scaler.get_scale()) if precision.scaler.is_enabled() else 1.0
        if precision.kind.loss_scaled:  # fp16: which modules' gradients underflow the scale
            half = [n for n, (dtype, _) in watch.ranges.items() if dtype == "float16"]
            last = _to(self.batches[order[-1]], self.device)
            under = grad_underflow_fractions(model, last, self.loss_fn, scale, half)
            modules = watch.module_ranges(under)
        return RunResult(curve, flat_params(model), first, modules, scale)
