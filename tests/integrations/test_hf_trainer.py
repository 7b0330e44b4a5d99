"""``memfit.integrations.hf.prepare`` with the Hugging Face Trainer, and the own loop on GPT-2.

GPT-2 keeps its default config here (``use_cache=True``, dropout 0.1, GELU, tied weights);
only its sizes are small (layers, width, context, a 256-token vocabulary) so that CPU tests
stay fast and the blocks, not the logits, hold most of the activations.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="memfit[hf] extra (transformers) not installed")
pytest.importorskip("accelerate", reason="the Hugging Face Trainer needs accelerate")

import memfit  # noqa: E402
from memfit.checkpointing import checkpointed_blocks  # noqa: E402
from memfit.errors import ConfigError  # noqa: E402
from memfit.integrations.hf import prepare  # noqa: E402
from memfit.integrations.hf_trainer import dict_loss, plan_for_trainer  # noqa: E402
from memfit.measuring.tracker import MemoryWatch  # noqa: E402

#: Both runs use torch's AdamW and clipping on the same batches, weights and dropout masks;
#: the Trainer's loss is normalised by the token count over the accumulated micro-batches,
#: memfit's by micro-batch shares: equal in exact arithmetic, a few ulps apart in fp32.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
SEQ = 32


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, n_positions=64, vocab_size=256)
    assert config.use_cache  # the default
    return transformers.GPT2LMHeadModel(config)


def _dataset(n: int = 40) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 256, (n, SEQ), generator=g)
    # NOTE: the model shifts the labels, so labels[0] is never a target; marking it ignored
    # makes the Trainer's token count (labels != -100, across accumulated micro-batches) the
    # number of targets, and its loss the plain mean that memfit's loss is.
    return [{"input_ids": r, "labels": torch.cat([torch.tensor([-100]), r[1:]])} for r in rows]


def _args(tmp_path: Path, **kw: object) -> object:
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, gradient_accumulation_steps=1,
        max_steps=5, learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, train_sampling_strategy="sequential", seed=0,
        dataloader_num_workers=0,
    )  # fmt: skip
    base.update(kw)
    return transformers.TrainingArguments(**base)


# 40%: no whole-batch plan fits, so the batch is split into micro-batches; at 60% the whole
# batch fits, and micro-batches are chosen only where they time faster (either is right:
# what is checked is that the Trainer's arguments and losses follow the plan).
@pytest.mark.parametrize("budget", ["60%", "40%"])
def test_prepare_plans_the_trainer_and_matches_the_own_loop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, budget: str
) -> None:
    data = _dataset()
    model = _gpt2()  # the default config: dropout on, use_cache on
    with caplog.at_level(logging.INFO, logger="memfit.integrations.hf"):
        plan, args = plan_for_trainer(model, _args(tmp_path), data, budget=budget, precision="fp32")
    if budget == "40%":
        assert plan.micro_batches > 1
    lines = [r.getMessage() for r in caplog.records]
    assert any("use_cache off" in m for m in lines) and sum("memfit: planned" in m for m in lines) == 1
    assert model.config.use_cache is False
    assert checkpointed_blocks(model) == {n: m for n, m in plan.blocks.items() if m != "none"} != {}
    assert args.gradient_accumulation_steps == plan.micro_batches
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 8
    assert args.bf16 is (plan.precision == "bf16") and args.fp16 is (plan.precision == "fp16")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    hf_losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(hf_losses) == 5 and all(torch.isfinite(torch.tensor(hf_losses)))

    own = _gpt2()
    own.config.use_cache = False
    opt_cls, opt_kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, own)
    opt = opt_cls(own.parameters(), **opt_kwargs)
    own, opt = memfit.prepare(own, opt, plan)
    loss_fn = dict_loss(["input_ids", "labels"])
    # NOTE: the same dropout masks: the Trainer seeds the global RNG with args.seed, and its
    # DataLoader's iterator draws one base seed from it before the first batch.
    torch.manual_seed(args.seed)
    torch.empty((), dtype=torch.int64).random_()
    losses = []
    for step in range(5):
        rows = data[8 * step : 8 * step + 8]
        batch = (torch.stack([r["input_ids"] for r in rows]), torch.stack([r["labels"] for r in rows]))
        losses.append(memfit.train_step(own, batch, loss_fn, opt, plan, clip_norm=args.max_grad_norm))
    torch.testing.assert_close(torch.tensor(hf_losses), torch.tensor(losses), **LOSS_TOL)


def test_hf_trainer_with_default_gpt2_trains_under_prepare(tmp_path: Path) -> None:
    data = _dataset(20)
    model = _gpt2()  # default config: dropout on, use_cache on
    args = prepare(model, _args(tmp_path, per_device_train_batch_size=4), data, budget="60%")
    assert checkpointed_blocks(model) and model.config.use_cache is False
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 5 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize(
    ("kw", "name"),
    # the deprecated alias is named as transformers spells it today
    [({"gradient_checkpointing": True}, "activation_checkpointing=True"),
     ({"auto_find_batch_size": True}, "auto_find_batch_size=True")],
)  # fmt: skip
def test_conflicting_arguments_are_named(tmp_path: Path, kw: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigError, match=f"drop {name} from TrainingArguments"):
        prepare(_gpt2(), _args(tmp_path, **kw), _dataset(8), budget="60%")


def test_own_loop_on_default_gpt2_equals_trainer_and_fits(tmp_path: Path) -> None:
    """prepare + train_step on GPT-2 with its default config (use_cache on, dropout on)."""
    g = torch.Generator().manual_seed(5)
    batches = [(x, x) for x in torch.randint(0, 256, (10, 4, SEQ), generator=g)]
    loss_fn = dict_loss(["input_ids", "labels"])
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = memfit.plan(model, batches[0], loss_fn, "60%", opt, precision="fp32")
    model, opt = memfit.prepare(model, opt, plan)
    torch.manual_seed(7)
    own, peaks = [], []
    for i, batch in enumerate(batches):
        if i == 1:
            with MemoryWatch(model, opt) as watch:
                own.append(memfit.train_step(model, batch, loss_fn, opt, plan))
            peaks.append(watch.peak_bytes)
        else:
            own.append(memfit.train_step(model, batch, loss_fn, opt, plan))
    reference = _gpt2()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    trainer = memfit.Trainer(reference, ref_opt, loss_fn, plan=plan, progress=False, track_memory=False)
    torch.manual_seed(7)
    history = trainer.fit(batches, steps=10)
    torch.testing.assert_close(torch.tensor(own), torch.tensor([m.loss for m in history]), rtol=0, atol=0)
    assert 0 < peaks[0] <= plan.budget_bytes, (peaks, plan.budget_bytes)


def test_prepare_with_a_saved_plan_does_not_plan_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decision made once is used as it is: ``prepare(..., plan=plan)`` profiles nothing, and a
    plan made for another model is refused in one sentence."""
    data = _dataset(8)
    plan, _ = plan_for_trainer(_gpt2(), _args(tmp_path), data, budget="60%", precision="fp32")
    saved = memfit.Plan.from_json(plan.to_json())

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("prepare(plan=...) profiled or planned")

    monkeypatch.setattr("memfit.integrations.hf_trainer.plan", refuse)
    monkeypatch.setattr("memfit.measuring.profile.Profiler.__init__", refuse)
    model = _gpt2()
    args = prepare(model, _args(tmp_path), data, plan=saved)
    assert checkpointed_blocks(model) == {n: m for n, m in saved.blocks.items() if m != "none"}
    assert args.gradient_accumulation_steps == saved.micro_batches
    other = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=3, n_embd=64, n_head=2, n_positions=64, vocab_size=256)
    )
    with pytest.raises(ConfigError, match="the plan was made for another model"):
        prepare(other, _args(tmp_path), data, plan=saved)
