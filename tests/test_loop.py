"""Your own loop: ``memfit.prepare`` + ``memfit.train_step`` against the Trainer and plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_gpt, token_batch

import memfit
from memfit.checkpointing import checkpointed_blocks
from memfit.errors import ConfigError
from memfit.loop import prepared
from memfit.measuring.tracker import MemoryWatch
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.records import Plan
from memfit.trainer.trainer import Trainer

#: The own loop and the Trainer run the same step function on the same weights: bit for bit.
SAME_STEP_TOL = dict(rtol=0.0, atol=0.0)
#: Micro-batches sum the gradient in another order than one big batch: a few ulps.
ACCUM_TOL = dict(rtol=1e-5, atol=1e-6)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_embd=64, n_head=2, block_size=64, dropout=0.0))


def _batches(n: int, batch: int = 8, seq: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [token_batch(batch, seq, seed=i) for i in range(n)]


@pytest.fixture(scope="module")
def planned() -> Plan:
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = memfit.plan(model, _batches(1)[0], gpt_loss, "60%", opt, precision="fp32")
    saves = any(m != "none" for m in plan.blocks.values()) or plan.micro_batches > 1
    assert saves, "the plan must checkpoint something or split the batch"
    return plan


def test_own_loop_equals_trainer_and_stays_under_budget(planned: Plan) -> None:
    batches = _batches(10)
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = memfit.prepare(model, opt, planned)
    assert checkpointed_blocks(model) == {n: m for n, m in planned.blocks.items() if m != "none"}
    own, peaks = [], []
    for i, batch in enumerate(batches):
        if i in (1, 5):  # steady state: the optimizer state exists from the first step on
            with MemoryWatch(model, opt) as watch:
                own.append(memfit.train_step(model, batch, gpt_loss, opt, planned))
            peaks.append(watch.peak_bytes)
        else:
            own.append(memfit.train_step(model, batch, gpt_loss, opt, planned))

    reference = _gpt()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    trainer = Trainer(reference, ref_opt, gpt_loss, plan=planned, progress=False, track_memory=False)
    history = trainer.fit(batches, steps=10)
    torch.testing.assert_close(torch.tensor(own), torch.tensor([m.loss for m in history]), **SAME_STEP_TOL)
    assert own[-1] < own[0]
    assert all(0 < p <= planned.budget_bytes for p in peaks), (peaks, planned.budget_bytes)


def test_micro_batches_and_clipping_equal_plain_pytorch() -> None:
    batch = token_batch(batch=4, seq=16)
    model = tiny_gpt()
    reference = copy.deepcopy(model)
    plan = Plan(blocks={"blocks.0": "full", "blocks.1": "selective"}, micro_batches=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = memfit.prepare(model, opt, plan)
    loss = memfit.train_step(model, batch, gpt_loss, opt, plan, clip_norm=0.5)

    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_loss = gpt_loss(reference, batch)
    ref_loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    ref_opt.step()
    assert loss == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, **ACCUM_TOL, msg=name)


def test_fp16_scaler_lives_across_steps() -> None:
    model = tiny_gpt(n_layer=1)
    plan = Plan(blocks={"blocks.0": "full"}, precision="fp16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = memfit.prepare(model, opt, plan)
    scaler = prepared(opt).precision.scaler
    assert scaler.is_enabled()
    for _ in range(3):
        memfit.train_step(model, token_batch(), gpt_loss, opt, plan)
    # the growth tracker counts finite steps since the last change: the scaler was kept
    assert scaler.state_dict()["_growth_tracker"] == 3 or scaler.get_scale() < 2.0**16


def test_prepare_is_required_and_plan_must_match() -> None:
    model = tiny_gpt(n_layer=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = Plan(blocks={"blocks.0": "full"})
    with pytest.raises(ConfigError, match=r"memfit\.prepare"):
        memfit.train_step(model, token_batch(), gpt_loss, opt, plan)
    memfit.prepare(model, opt, plan)
    with pytest.raises(ConfigError, match=r"not the one given to memfit\.prepare"):
        memfit.train_step(model, token_batch(), gpt_loss, opt, Plan(blocks={"blocks.0": "selective"}))
    with pytest.raises(ConfigError, match="another model"):
        memfit.train_step(tiny_gpt(n_layer=1), token_batch(), gpt_loss, opt, plan)
    with pytest.raises(ConfigError, match="does not have"):
        memfit.prepare(model, opt, Plan(blocks={"layers.0": "full"}))
    with pytest.raises(ConfigError, match="contradicts"):
        memfit.prepare(model, opt, plan, precision=memfit.Precision("bf16", device="cpu"))
