"""Is mixed precision still right? Train with fp32 and with each precision, side by side.

Every run starts from identical initial weights and sees identical batches; only the
precision (and the checkpointing plan, if given) differs. A second fp32 run with another
data order and another dropout seed measures how far two equally valid runs drift apart:
the noise band. A precision passes when its final loss stays within a few noise bands of
fp32, its gradients have the same size, the loss scaler did not lose many steps and no
value overflowed (see :mod:`memfit.check.verdict`).

Trade-off: the check costs ``len(precisions) + 2`` short training runs (and hooks on every
module while they run), so it is for before a long run, not for every step of one.

Example:
    >>> import torch
    >>> from memfit.models.gpt import GPT, GPTConfig, gpt_loss
    >>> def model_fn():
    ...     return GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8))
    >>> batches = [(torch.randint(0, 256, (2, 8)),) * 2 for _ in range(3)]
    >>> report = check_stability(model_fn, batches, gpt_loss,
    ...                          lambda ps: torch.optim.AdamW(ps, lr=1e-3), ("bf16",), steps=3)
    >>> report.by_precision["bf16"].verdict in ("PASS", "WARN", "FAIL")
    True
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from memfit.applying import check_plan_fits, normalize_levers
from memfit.check.runs import CheckRunner, OptimizerFn, RunResult, finite, flat_params
from memfit.check.verdict import Thresholds, judge, worst
from memfit.devices import DeviceFacts, device_facts
from memfit.errors import ConfigError, UnsupportedPrecision
from memfit.precision import Precision, precision_kind
from memfit.progress import configured, phase
from memfit.records import Plan, PrecisionCheck, StabilityReport
from memfit.step import Batch, LossFn
from memfit.vocab import MIXED_PRECISIONS, PrecisionName, normalize_precision

__all__ = ["check_stability", "hardware_facts"]


def hardware_facts(facts: DeviceFacts, precisions: Sequence[str]) -> list[str]:
    """What the check's result depends on about this device, in words."""
    lines = [f"device: {facts.name}, {facts.description}"]
    for p in precisions:
        if precision_kind(p).native(facts):
            lines.append(f"{p} runs natively on this device: the numerics checked are the ones training gets")
        else:
            lines.append(
                f"{p} is not native on this {facts.type.upper()}: the check covers numerics only and says "
                "nothing about speed"
            )
    return lines + [f"note: {n}" for n in facts.notes]


def _validate(precisions: Sequence[str], steps: int, batches: Sequence[Batch]) -> list[PrecisionName]:
    if isinstance(precisions, str):
        raise ConfigError(f"precisions must be a list of modes such as ('bf16', 'fp16'), not {precisions!r}.")
    if not precisions:
        raise ConfigError("precisions is empty; give at least one of 'bf16' or 'fp16'.")
    checked = [_checked_precision(p) for p in precisions]
    if len(set(precisions)) != len(precisions):
        raise ConfigError(f"precisions {list(precisions)} name a mode twice; name each once.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps must be a positive number of training steps, got {steps!r}.")
    if len(batches) == 0:
        raise ConfigError("batches is empty; give at least one batch to train on.")
    return checked


def _checked_precision(precision: str) -> PrecisionName:
    try:
        return cast(PrecisionName, normalize_precision(precision))
    except ConfigError as exc:
        raise UnsupportedPrecision(str(exc)) from None


def _median_ratio(a: list[float | None], b: list[float | None]) -> float | None:
    ratios = [x / y for x, y in zip(a, b, strict=False) if x is not None and y is not None and y > 0]
    return statistics.median(ratios) if ratios else None


def _drift(params: torch.Tensor, ref: torch.Tensor, start: torch.Tensor) -> float | None:
    moved = float((ref - start).norm())
    value = float((params - ref).norm()) / moved if moved > 0 else None
    return finite(value)


@dataclass(frozen=True)
class _Setup:
    """What every run of one check shares besides the :class:`CheckRunner`'s inputs."""

    steps: int
    seed: int
    thresholds: Thresholds
    order: list[int]
    """Batch indices of the reference run and of every precision run."""
    shuffled: list[int]
    """The noise run's batch indices: the same batches in another order."""
    eval_batches: Sequence[Batch]
    blocks: dict[str, str] | None
    micro_batches: int
    levers: list[str]


def _setup(
    batches: Sequence[Batch],
    steps: int,
    seed: int,
    plan: Plan | None,
    eval_batches: Sequence[Batch] | None,
    thresholds: Thresholds | None,
    levers: Sequence[str] | None,
) -> _Setup:
    n = len(batches)
    order = [i % n for i in range(steps)]
    shuffled = [order[i] for i in torch.randperm(steps, generator=torch.Generator().manual_seed(seed + 1))]
    if eval_batches is None:
        eval_batches = [batches[i] for i in sorted({round(k * (n - 1) / 3) for k in range(4)})]
    if len(eval_batches) == 0:
        raise ConfigError("eval_batches is empty; give at least one batch or leave it out.")
    return _Setup(
        steps=steps,
        seed=seed,
        thresholds=thresholds or Thresholds(),
        order=order,
        shuffled=shuffled,
        eval_batches=eval_batches,
        blocks=dict(plan.blocks) if plan else None,
        micro_batches=plan.micro_batches if plan else 1,
        levers=normalize_levers(list(plan.levers) if plan and levers is None else levers),
    )


@dataclass(frozen=True)
class _Reference:
    """The fp32 reference run, the noise run and the band they make."""

    ref: RunResult
    noise: RunResult
    band: float


# Note [NF4 judged against the bf16 base]
# frozen_nf4 changes the frozen base itself (a quantization error of a few percent per
# weight), so it cannot follow plain fp32 training of the same base; what QLoRA promises is
# training like the base held in bf16. A check with frozen_nf4 therefore takes its
# reference and noise runs at bf16 with the frozen base in bf16 (frozen_bf16) and no other
# lever: the NF4 runs pass when they stay within the noise band of that training.


def _reference_mode(levers: Sequence[str]) -> tuple[str, PrecisionName, list[str]]:
    """The reference runs' name, precision and levers: fp32 and none, or the bf16 base."""
    if "frozen_nf4" in levers:
        return "bf16 base (frozen_bf16)", "bf16", ["frozen_bf16"]
    return "fp32", "fp32", []


def _reference(checker: CheckRunner, s: _Setup) -> _Reference:
    name, mode, levers = _reference_mode(s.levers)
    ref = checker.run(name, mode, s.order, s.seed, s.eval_batches, levers=levers)
    if None in ref.curve.losses or ref.curve.eval_loss is None:
        raise ConfigError(
            f"the fp32 reference run itself produced a non-finite loss at step {len(ref.curve.losses)}; "
            "fix the model, data or learning rate in fp32 before checking mixed precision."
        )
    noise = checker.run(f"{name} (noise)", mode, s.shuffled, s.seed + 1, s.eval_batches, levers=levers)
    floor = s.thresholds.band_floor * abs(ref.curve.eval_loss)
    noise_delta = (
        abs(noise.curve.eval_loss - ref.curve.eval_loss) if noise.curve.eval_loss is not None else math.inf
    )
    return _Reference(ref, noise, max(noise_delta, floor))


def _check_precision(
    checker: CheckRunner, s: _Setup, r: _Reference, precision: PrecisionName, start: torch.Tensor
) -> PrecisionCheck:
    """Run ``precision`` and judge it against fp32 (an fp32 twin skipping its skipped steps)."""
    p = precision
    run = checker.run(p, p, s.order, s.seed, s.eval_batches, s.blocks, s.micro_batches, levers=s.levers)
    skipped = frozenset(i for i, k in enumerate(run.curve.skipped, start=1) if k)
    base, twin = r.ref, None
    if skipped and len(skipped) <= s.thresholds.fail_skip_fraction * s.steps:
        # A skipped step is the loss scaler working, not an arithmetic error, but early in
        # training one lost update can move the loss far (loss spikes). So the numbers
        # compare with an fp32 run that skips the same steps; the skips themselves are
        # judged by their own thresholds.
        label = f"fp32 (skipping {p}'s skipped steps)"
        twin = checker.run(label, "fp32", s.order, s.seed, s.eval_batches, skip=skipped)
        base = twin
    assert base.curve.eval_loss is not None
    delta = abs(run.curve.eval_loss - base.curve.eval_loss) if run.curve.eval_loss is not None else None
    pc = PrecisionCheck(
        precision=p,
        verdict="",
        reasons=[],
        run=run.curve,
        loss_delta=delta,
        band_multiple=finite(delta / r.band) if delta is not None and r.band > 0 else None,
        grad_norm_ratio=_median_ratio(run.curve.grad_norms, base.curve.grad_norms),
        param_drift=_drift(run.params, base.params, start),
        skipped_steps=len(skipped),
        final_scale=run.final_scale,
        first_nonfinite=run.first_nonfinite,
        modules=run.modules,
        reference_run=twin.curve if twin is not None else None,
    )
    pc.verdict, pc.reasons = judge(pc, s.thresholds)
    if base.curve.precision != "fp32":  # See Note [NF4 judged against the bf16 base]
        pc.reasons = [t.replace(" fp32", " the bf16 base") for t in pc.reasons]
    return pc


def check_stability(
    model_fn: Callable[[], nn.Module],
    batches: Sequence[Batch],
    loss_fn: LossFn,
    optimizer_fn: OptimizerFn,
    precisions: Sequence[str] = MIXED_PRECISIONS,
    steps: int = 50,
    *,
    plan: Plan | None = None,
    eval_batches: Sequence[Batch] | None = None,
    device: str | torch.device | None = None,
    clip_norm: float | None = None,
    seed: int = 0,
    thresholds: Thresholds | None = None,
    progress: bool | None = None,
    levers: Sequence[str] | None = None,
) -> StabilityReport:
    """Train with fp32 and with each precision from identical weights and batches, and judge.

    Args:
        model_fn: builds a fresh model; called once per run (torch is seeded with ``seed``
            first) and must build identical initial weights every time.
        batches: training batches; step ``i`` uses ``batches[i % len(batches)]``.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        optimizer_fn: ``optimizer_fn(params) -> optimizer``.
        precisions: the modes to check against fp32 (``"bf16"``, ``"fp16"``).
        steps: training steps per run.
        plan: a checkpointing plan applied to the mixed-precision runs (its blocks and
            micro-batches), so that the combination is what is checked.
        eval_batches: batches the final weights are judged on, in fp32 (default: up to 4
            of ``batches``).
        device: where to train (default: CUDA if present, else CPU).
        clip_norm: gradient clipping as in training (None: no clipping; norms are still measured).
        seed: seed of the weights and of the reference run's dropout.
        thresholds: verdict thresholds (default :class:`~memfit.check.verdict.Thresholds`).
        progress: True: show progress (:mod:`memfit.progress`: a bar on a terminal, lines in
            a log); False: none; None (default): as :mod:`memfit.progress` decides.
        levers: levers (:mod:`memfit.levers`) the precision runs use (default: the plan's);
            the fp32 reference and noise runs use none, so the check proves the levers train
            the same model as plain fp32 AdamW (with ``frozen_nf4``, the reference is the
            frozen base held in bf16: See Note [NF4 judged against the bf16 base]).

    Returns:
        A :class:`~memfit.records.StabilityReport`.

    Raises:
        UnsupportedPrecision: an unknown precision, or one the device cannot run.
        ConfigError: no steps, no batches, or a ``model_fn`` whose models differ.
        LeverRefused: a lever cannot run on this device, optimizer or precision.
    """
    checked = _validate(precisions, steps, batches)
    facts = device_facts(device)
    dev = torch.device(facts.name)
    for p in checked:
        Precision(p, device=dev)  # raises early when the device cannot run it
    s = _setup(batches, steps, seed, plan, eval_batches, thresholds, levers)
    runs = f"checking {', '.join(checked)} against fp32 ({len(checked) + 2} runs of {steps} steps)"
    with configured(quiet=None if progress is None else not progress), phase(runs):
        checker = CheckRunner(model_fn, batches, loss_fn, optimizer_fn, dev, seed, clip_norm)
        first = checker.build()
        if plan is not None:
            check_plan_fits(first, plan, levers=False)  # the runs apply the levers themselves
        start = flat_params(first)
        r = _reference(checker, s)
        results: dict[str, PrecisionCheck] = {p: _check_precision(checker, s, r, p, start) for p in checked}
    return StabilityReport(
        verdict=worst([pc.verdict for pc in results.values()]),
        by_precision=results,
        reference=r.ref.curve,
        noise=r.noise.curve,
        noise_band=r.band,
        noise_param_drift=_drift(r.noise.params, r.ref.params, start),
        steps=steps,
        device=facts.name,
        hardware=hardware_facts(facts, checked),
        thresholds=s.thresholds.to_dict(),
        checkpointing=s.blocks or {},
        micro_batches=s.micro_batches,
        levers=s.levers,
    )
