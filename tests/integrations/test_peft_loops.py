"""A PeftModel in every loop memfit plans for: memfit.Trainer, memfit.check_stability, Lightning
and accelerate, each planned at 50% and leaving the frozen base as it was."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="memfit[peft] extra (transformers) not installed")
peft = pytest.importorskip("peft", reason="memfit[peft] extra (peft) not installed")

import memfit  # noqa: E402
from memfit.checkpointing import checkpointed_blocks  # noqa: E402

VOCAB, SEQ, BATCH = 96, 32, 8


def _build() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    lora = peft.LoraConfig(r=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


def _adapters(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-3)  # type: ignore[attr-defined]


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, VOCAB, (4 * BATCH, SEQ), generator=g))


def _frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def _unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters() if n in before)


def test_memfit_trainer_and_check_stability_take_a_peft_model() -> None:
    model, data = _build(), _data()
    opt = _adapters(model.parameters())
    before = _frozen(model)
    plan = memfit.plan(model, data[:BATCH], _loss, "50%", opt, "fp32")
    memfit.apply(model, plan)
    trainer = memfit.Trainer(model, opt, _loss, plan=plan)
    trainer.fit([data[:BATCH]] * 3, steps=3)
    assert math.isfinite(trainer.history[-1].loss) and _unchanged(model, before)
    report = memfit.check_stability(_build, [data[:BATCH]], _loss, _adapters, precisions=["bf16"], steps=3)
    assert report.verdict in ("PASS", "WARN"), report.verdict


def test_lightning_callback_takes_a_peft_model() -> None:
    lightning = pytest.importorskip("lightning")
    from memfit.integrations.lightning import MemfitCallback, trainer_kwargs

    class Lit(lightning.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = _build()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return _loss(self.model, tuple(batch))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _adapters(self.parameters())

    lit, data = Lit(), _data()
    before = _frozen(lit.model)
    plan = memfit.plan(lit.model, data[:BATCH], _loss, "50%", lit.configure_optimizers(), "fp32")
    trainer = lightning.Trainer(
        max_steps=3, callbacks=[MemfitCallback(plan)], **trainer_kwargs(plan), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(lit, DataLoader(data, batch_size=BATCH // plan.micro_batches))
    assert checkpointed_blocks(lit.model) == {n: m for n, m in plan.blocks.items() if m != "none"} != {}
    assert _unchanged(lit.model, before)


def test_accelerate_recipe_takes_a_peft_model() -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    from memfit.integrations.accelerate import accelerator_kwargs

    AcceleratorState._reset_state(reset_partial_state=True)
    model, data = _build(), _data()
    opt = _adapters(model.parameters())
    before = _frozen(model)
    plan = memfit.plan(model, data[:BATCH], _loss, "50%", opt, "fp32")
    memfit.apply(model, plan)
    acc = accelerate.Accelerator(**accelerator_kwargs(plan))
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=BATCH // plan.micro_batches))
    losses = []
    for batch in loader:
        with acc.accumulate(model):
            loss = _loss(model, tuple(batch))
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and _unchanged(model, before)
