"""Hugging Face's own checkpointing beside memfit's: refused in one sentence, in the user's spelling.

transformers 5.24 renamed ``gradient_checkpointing*`` to ``activation_checkpointing*``
(``TrainingArguments(activation_checkpointing=True)``, ``model.activation_checkpointing_enable(
every_n_layers=..., offload=...)``); the old names are deprecated aliases, removed in v6. memfit
names back the call as it was made and never checkpoints a layer twice: not in
``memfit.integrations.hf.prepare``, not in ``memfit.checkpoint`` / the Lightning callback, not
when Hugging Face's is turned on after memfit's. Runs in .venv-extras and .venv-newest.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="memfit[hf] extra (transformers) not installed")
pytest.importorskip("accelerate", reason="the Hugging Face Trainer needs accelerate")
if not hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable"):
    pytest.skip("this transformers spells it gradient_checkpointing only", allow_module_level=True)

import memfit  # noqa: E402
from memfit.checkpointing import checkpointed_blocks  # noqa: E402
from memfit.errors import ConfigError  # noqa: E402
from memfit.integrations.hf import build_hf_causal_lm, hf_causal_loss, prepare  # noqa: E402
from memfit.records import Plan  # noqa: E402

SEQ = 16


def _one_sentence(message: str) -> str:
    """``message``, checked to be one sentence: a period at its end and nowhere else before a space."""
    assert message.endswith(".") and not re.search(r"[.!?]\s", message[:-1]), message
    assert "gradient_checkpointing" not in message, message  # the deprecated spelling is never suggested
    return message


def _llama(block_size: int = SEQ) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_hf_causal_lm("llama", n_layer=4, n_embd=32, n_head=2, block_size=block_size)


def _dataset(n: int = 8, seq: int = SEQ) -> list[dict[str, torch.Tensor]]:
    rows = torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": r, "labels": r} for r in rows]


def _args(tmp_path: Path, **kw: object) -> object:
    base: dict[str, object] = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    base.update(kw)
    return transformers.TrainingArguments(**base)


def test_training_arguments_activation_checkpointing_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        prepare(_llama(), _args(tmp_path, activation_checkpointing=True), _dataset(), budget="60%")
    message = _one_sentence(str(err.value))
    assert message.startswith("drop activation_checkpointing=True from TrainingArguments")


def test_training_arguments_offload_is_named(tmp_path: Path) -> None:
    args = _args(tmp_path, activation_checkpointing=True, activation_checkpointing_kwargs={"offload": True})
    with pytest.raises(ConfigError) as err:
        prepare(_llama(), args, _dataset(), budget="60%")
    message = _one_sentence(str(err.value))
    named = "drop activation_checkpointing=True and activation_checkpointing_kwargs={'offload': True}"
    assert named in message
    assert "offload to host memory" in message


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({}, "model.activation_checkpointing_enable()"),
        ({"every_n_layers": 2}, "model.activation_checkpointing_enable(every_n_layers=2)"),
        ({"offload": True}, "model.activation_checkpointing_enable(offload=True)"),
    ],
)
def test_model_checkpointed_by_hugging_face_is_named(tmp_path: Path, kwargs: dict, named: str) -> None:
    model = _llama()
    model.activation_checkpointing_enable(**kwargs)
    with pytest.raises(ConfigError) as err:
        prepare(model, _args(tmp_path), _dataset(), budget="60%")
    message = _one_sentence(str(err.value))
    assert f"Hugging Face activation checkpointing is on for this model ({named})" in message
    assert "call model.activation_checkpointing_disable()" in message
    assert ("memfit's plan does not count" in message) == ("offload" in kwargs)
    assert checkpointed_blocks(model) == {}  # nothing of memfit's added


def test_turned_on_after_memfit_is_refused_not_doubled(tmp_path: Path) -> None:
    model, data = _llama(block_size=128), _dataset(seq=128)
    # a plan that checkpoints, given: at a budget, two micro-batches can tie checkpointing
    # (See Note [micro-batches where they are faster] in memfit/planning/choose.py)
    names = memfit.find_blocks(model)
    plan = Plan(blocks={n: "full" if i % 2 == 0 else "none" for i, n in enumerate(names)}, precision="fp32")
    args = prepare(model, _args(tmp_path), data, plan=plan)
    assert checkpointed_blocks(model), "the plan checkpoints some blocks"
    # The Trainer turns Hugging Face's checkpointing on when its arguments ask for it.
    micro = args.per_device_train_batch_size
    args = _args(tmp_path, activation_checkpointing=True, per_device_train_batch_size=micro)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    with pytest.raises(ConfigError) as err:
        trainer.train()
    message = _one_sentence(str(err.value))
    assert "turned on for LlamaDecoderLayer after memfit checkpointed it" in message
    assert "model.activation_checkpointing_disable()" in message


def test_own_loop_after_memfit_with_offload_is_refused() -> None:
    model = _llama()
    memfit.checkpoint(model, mode="selective")
    model.activation_checkpointing_enable(offload=True)
    x = torch.randint(0, 256, (2, SEQ + 1))
    with pytest.raises(ConfigError) as err:
        hf_causal_loss(model, (x[:, :-1], x[:, 1:]))
    _one_sentence(str(err.value))


def test_lightning_callback_names_the_hugging_face_call() -> None:
    lightning = pytest.importorskip("lightning", reason="lightning is not installed")
    from memfit.integrations.lightning import MemfitCallback, trainer_kwargs

    class LitLlama(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _llama()
            self.model.activation_checkpointing_enable(every_n_layers=2, offload=True)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return hf_causal_loss(self.model, (batch[0][:, :-1], batch[0][:, 1:]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = LitLlama()
    plan = Plan(blocks={f"model.layers.{i}": "full" for i in range(4)}, precision="fp32", micro_batches=1)
    trainer = lightning.Trainer(
        max_steps=1, callbacks=[MemfitCallback(plan)], **trainer_kwargs(plan), accelerator="cpu",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.randint(0, 256, (4, SEQ + 1)))
    with pytest.raises(ConfigError) as err:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    message = _one_sentence(str(err.value))
    assert "(model.activation_checkpointing_enable(every_n_layers=2, offload=True))" in message
    assert checkpointed_blocks(module.model) == {}
