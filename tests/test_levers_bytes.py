"""Issue 14's bytes acceptance, measured: the built-in GPT (6 layers, 384 wide, sequence 256,
batch 8) with every lever a CPU can run plus full checkpointing.

- measured peak <= 0.25x the fp32 peak without checkpointing (MemTracker, both);
- model state at that peak (weights + gradients + optimizer, the latter including the one
  parameter's step temporaries MemTracker counts as optimizer) <= 6 bytes per parameter;
- the step model's prediction (a bf16 profile of the same model with bf16 weights, levers
  applied by memfit.stepmodel.with_levers.with_levers) within 5% of the measured peak.

The optimizer step runs eagerly (``TORCHDYNAMO_DISABLE=1``), as MemTracker sees it, and the
step model prices that step. bf16 is emulated on a CPU: marked slow, run by ``make test``.
"""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit.applying import apply, remove_levers, with_levers
from memfit.levers.weights import cast_weights
from memfit.measuring.lever_facts import attach_lever_facts
from memfit.measuring.preserve import create_optimizer_state, preserved
from memfit.measuring.profile import Profiler
from memfit.measuring.tracker import MemoryWatch
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.precision import Precision
from memfit.records import Plan
from memfit.step import training_step
from memfit.stepmodel import simulate

pytest.importorskip("torchao")

LEVERS = ["fused_step", "state_4bit", "weights_bf16"]


def _tracked(model: torch.nn.Module, batch, opt: torch.optim.Optimizer, prec: Precision) -> MemoryWatch:
    # NOTE: the optimizer's state from one step on zero gradients (no forward): the tracked
    # step is a steady-state one without paying a whole warm-up step.
    with torch.compiler.set_stance("force_eager"):
        create_optimizer_state(model, opt)
    with MemoryWatch(model, opt) as watch:
        training_step(model, batch, gpt_loss, opt, prec)
    return watch


@pytest.mark.slow
def test_all_cpu_levers_and_full_checkpointing_reach_a_quarter_of_the_fp32_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torchao's step runs eagerly, as MemTracker sees it, and is priced so
    # (Note [pricing the step that runs])
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6, n_embd=384, n_head=6, block_size=256))
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, 256, (8, 256))
    batch = (x, x)
    blocks = memfit.find_blocks(model)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with preserved(model, opt):
        fp32 = _tracked(model, batch, opt, Precision("fp32")).peak_bytes

    cast_weights(model)
    bf16 = Precision("bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with preserved(model, opt):
        profiler = Profiler(model, batch, gpt_loss, opt, bf16)
        profiler.none()
        profiler.modes(["full"])
        profile = attach_lever_facts(profiler.result(), model, opt, blocks)
    predicted = simulate(with_levers(profile, LEVERS), "full").peak_bytes

    plan = Plan(blocks=dict.fromkeys(blocks, "full"), precision="bf16", levers=LEVERS)
    lever_opt = apply(model, plan, torch.optim.AdamW(model.parameters(), lr=1e-3)).optimizer
    watch = _tracked(model, batch, lever_opt, bf16)
    remove_levers(model, lever_opt)
    measured = watch.peak_bytes
    state = sum(watch.breakdown[k] for k in ("params", "grads", "optimizer"))

    print(
        f"fp32 no checkpointing {fp32} B; levers {LEVERS} + full checkpointing: measured {measured} B "
        f"({measured / fp32:.3f}x), predicted {predicted} B ({predicted / measured - 1:+.2%}), "
        f"model state {state / n_params:.2f} B/param, breakdown {watch.breakdown}"
    )
    assert measured <= 0.25 * fp32
    assert state <= 6 * n_params
    assert abs(predicted - measured) <= 0.05 * measured
