"""Lightning (``MemfitCallback`` + ``trainer_kwargs``) and the accelerate recipe against the own loop."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import memfit
from memfit.checkpointing import checkpointed_blocks
from memfit.errors import ConfigError
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.records import Plan

#: The same fp32 steps, accumulated by the library instead of memfit: a few ulps apart.
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
BATCH, SEQ, STEPS = 8, 32, 5


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=SEQ))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (BATCH * STEPS, SEQ + 1), generator=g)
    return TensorDataset(x[:, :-1].contiguous(), x[:, 1:].contiguous())


def _plan(budget: str = "45%") -> Plan:
    model = _gpt()
    x, y = _data()[:BATCH]
    plan = memfit.plan(model, (x, y), gpt_loss, budget, torch.optim.AdamW(model.parameters()), "fp32")
    assert plan.micro_batches > 1 and any(m != "none" for m in plan.blocks.values()), plan
    return plan


@pytest.fixture(scope="module")
def plan() -> Plan:
    return _plan()


def _own_losses(plan: Plan) -> list[float]:
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = memfit.prepare(model, opt, plan)
    data = _data()
    return [
        memfit.train_step(model, data[i * BATCH : (i + 1) * BATCH], gpt_loss, opt, plan) for i in range(STEPS)
    ]


def test_lightning_callback_trains_with_the_plan(plan: Plan) -> None:
    lightning = pytest.importorskip("lightning", reason="lightning is not installed")
    from memfit.integrations.lightning import MemfitCallback, trainer_kwargs

    class LitGPT(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt()
            self.losses: list[float] = []

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = gpt_loss(self.model, tuple(batch))
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = LitGPT()
    trainer = lightning.Trainer(
        max_steps=STEPS, callbacks=[MemfitCallback(plan)], **trainer_kwargs(plan), accelerator="cpu",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(_data(), batch_size=BATCH // plan.micro_batches))
    assert trainer.global_step == STEPS
    assert checkpointed_blocks(module.model) == {n: m for n, m in plan.blocks.items() if m != "none"}
    k = plan.micro_batches
    per_step = [sum(module.losses[i * k : (i + 1) * k]) / k for i in range(STEPS)]
    torch.testing.assert_close(torch.tensor(per_step), torch.tensor(_own_losses(plan)), **LOSS_TOL)


def test_lightning_callback_names_the_trainer_arguments_to_set(plan: Plan) -> None:
    lightning = pytest.importorskip("lightning", reason="lightning is not installed")
    from memfit.integrations.lightning import MemfitCallback

    class Tiny(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return gpt_loss(self.model, tuple(batch))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = lightning.Trainer(
        max_steps=1, callbacks=[MemfitCallback(plan)], accelerator="cpu", logger=False,
        enable_checkpointing=False, enable_progress_bar=False,
    )  # fmt: skip
    want = f"accumulate_grad_batches={plan.micro_batches}"
    with pytest.raises(ConfigError, match=f"lightning.Trainer\\(precision='32-true', {want}\\)"):
        trainer.fit(Tiny(), DataLoader(_data(), batch_size=BATCH))


def test_accelerate_recipe_matches_the_own_loop(plan: Plan) -> None:
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")
    from memfit.integrations.accelerate import accelerator_kwargs

    model = _gpt()
    memfit.apply(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = accelerate.Accelerator(cpu=True, **accelerator_kwargs(plan))
    loader = DataLoader(_data(), batch_size=BATCH // plan.micro_batches)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    micro_losses = []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = gpt_loss(model, (x, y))
            micro_losses.append(float(loss.detach()))
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
    assert checkpointed_blocks(accelerator.unwrap_model(model)) == {
        n: m for n, m in plan.blocks.items() if m != "none"
    }
    k = plan.micro_batches
    per_step = [sum(micro_losses[i * k : (i + 1) * k]) / k for i in range(STEPS)]
    torch.testing.assert_close(torch.tensor(per_step), torch.tensor(_own_losses(plan)), **LOSS_TOL)
