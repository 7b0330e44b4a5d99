"""The Trainer: precisions, gradient accumulation, clipping, plans, hooks, save/load."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DropoutMLP, mse_loss, tiny_gpt, token_batch, vector_batch

from memfit import Plan
from memfit.checkpointing import checkpoint, checkpointed_blocks, set_block_modes
from memfit.errors import ConfigError
from memfit.measuring.memory import measure
from memfit.models.gpt import gpt_loss
from memfit.records import StepMetrics
from memfit.trainer.callbacks import Callback
from memfit.trainer.trainer import Trainer

EXACT = {"rtol": 0.0, "atol": 0.0}
#: Accumulating micro-batch gradients sums in a different order than one big batch.
ACCUM_TOL = {"rtol": 1e-5, "atol": 1e-6}
#: bf16/fp16 autocast against fp32 on one step of a tiny GPT (about 3 significant digits).
HALF_LOSS_TOL = {"rtol": 0.0, "atol": 0.05}


def _trainer(model: torch.nn.Module, precision: str = "fp32", **kw) -> Trainer:  # type: ignore[no-untyped-def]
    opt = torch.optim.AdamW(model.parameters(), lr=kw.pop("lr", 1e-2))
    return Trainer(model, opt, kw.pop("loss_fn", gpt_loss), precision, progress=False, **kw)


def test_fp32_fit_reports_each_step_and_loss_goes_down() -> None:
    batch = token_batch(batch=4)
    trainer = _trainer(tiny_gpt())
    history = trainer.fit([batch] * 8, steps=8)
    assert [m.step for m in history] == list(range(1, 9))
    assert history[-1].loss < history[0].loss - 0.5
    first = history[0]
    assert first.samples == 4 and first.tokens == 4 * 16
    assert first.tokens_per_s > 0 and first.lr == pytest.approx(1e-2)
    assert first.scale == 1.0 and not first.skipped
    # memory is tracked on the first steady-state step (optimizer state exists) only
    assert first.peak_bytes is None and history[1].peak_bytes is not None
    assert all(m.peak_bytes is None for m in history[2:])
    assert [m.tracked for m in history[:3]] == [False, True, False]
    assert trainer.memory is not None and trainer.memory.peak_bytes == history[1].peak_bytes
    assert sum(trainer.memory.breakdown.values()) == trainer.memory.peak_bytes


def test_tracked_peak_equals_measure() -> None:
    """The Trainer's tracked step counts the same bytes as memfit.measure on the same state."""
    batch = token_batch(batch=4)
    model = tiny_gpt()
    reference = copy.deepcopy(model)
    trainer = _trainer(model)
    trainer.fit([batch] * 2, steps=2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    assert trainer.memory is not None
    assert measure(reference, batch, gpt_loss, ref_opt, steps=1).peak_bytes == trainer.memory.peak_bytes


def test_memory_every_tracks_more_steps() -> None:
    trainer = _trainer(tiny_gpt(n_layer=1), memory_every=2)
    history = trainer.fit([token_batch(batch=2, seq=8)] * 4, steps=4)
    assert [m.step for m in history if m.peak_bytes is not None] == [2, 4]
    off = _trainer(tiny_gpt(n_layer=1), track_memory=False)
    assert all(m.peak_bytes is None for m in off.fit([token_batch(batch=2, seq=8)] * 3, steps=3))


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_half_precision_trainer_matches_fp32_first_loss(mode: str) -> None:
    batch = token_batch(batch=2, seq=8)
    ref = _trainer(tiny_gpt(n_layer=1)).step(batch)
    trainer = _trainer(tiny_gpt(n_layer=1), mode)
    history = trainer.fit([batch] * 3, steps=3)
    assert trainer.precision.mode == mode
    torch.testing.assert_close(torch.tensor(history[0].loss), torch.tensor(ref.loss), **HALF_LOSS_TOL)
    assert all(torch.isfinite(torch.tensor(m.loss)) for m in history)
    if mode == "fp16":
        assert trainer.precision.scaler.is_enabled() and history[0].scale == 65536.0
    else:
        assert history[0].scale == 1.0


def test_fp16_overflow_is_a_skipped_step() -> None:
    calls = []

    def exploding_loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        calls.append(1)
        loss = gpt_loss(model, batch)
        return loss * 1e30 if len(calls) == 1 else loss

    model = tiny_gpt(n_layer=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(model, "fp16", loss_fn=exploding_loss)
    first = trainer.step(token_batch(batch=2, seq=8))
    assert first.skipped and first.scale == 65536.0
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], **EXACT)  # the optimizer step was skipped
    second = trainer.step(token_batch(batch=2, seq=8))
    assert second.scale == 32768.0 and not second.skipped


def test_gradient_accumulation_equals_larger_batch() -> None:
    batch = token_batch(batch=8)
    big, accum = tiny_gpt(), tiny_gpt()
    a = _trainer(big).step(batch)
    b = _trainer(accum, micro_batches=4).step(batch)
    torch.testing.assert_close(torch.tensor(b.loss), torch.tensor(a.loss), **ACCUM_TOL)
    for (name, p), q in zip(big.named_parameters(), accum.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, **ACCUM_TOL, msg=name)


@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_clipping_bounds_the_gradient_norm(mode: str) -> None:
    batch = token_batch(batch=2, seq=8)
    reference = tiny_gpt(n_layer=1)
    gpt_loss(reference, batch).backward()
    unclipped = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None])
    model = tiny_gpt(n_layer=1)
    metrics = _trainer(model, mode, clip_norm=0.05, lr=0.0).step(batch)
    # the reported norm is the true (unscaled) norm before clipping, even under fp16
    assert metrics.grad_norm is not None
    assert metrics.grad_norm == pytest.approx(float(unclipped), rel=0.05 if mode == "fp16" else 1e-5)
    assert metrics.grad_norm > 0.05
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert float(torch.nn.utils.get_total_norm(grads)) == pytest.approx(0.05, rel=1e-3)


def test_plan_sets_precision_and_micro_batches() -> None:
    model = tiny_gpt()
    set_block_modes(model, {"blocks.0": "full"})
    plan = Plan(blocks={"blocks.0": "full", "blocks.1": "keep"}, precision="bf16", micro_batches=2)
    trainer = _trainer(model, None, plan=plan)
    assert trainer.precision.mode == "bf16" and trainer.micro_batches == 2
    with pytest.raises(ConfigError, match="contradicts the plan"):
        _trainer(model, "fp16", plan=plan)
    fresh = tiny_gpt()  # not yet checkpointed: the Trainer applies the plan (memfit.prepare)
    _trainer(fresh, None, plan=plan)
    assert checkpointed_blocks(fresh) == {"blocks.0": "full"}


def test_callbacks_see_every_step_and_can_stop() -> None:
    seen: list[int] = []

    class StopAtThree(Callback):
        def on_step_end(self, trainer: Trainer, metrics: StepMetrics) -> None:
            seen.append(metrics.step)
            if metrics.step == 3:
                trainer.stop("enough")

    trainer = _trainer(tiny_gpt(n_layer=1), callbacks=[StopAtThree()], track_memory=False)
    history = trainer.fit([token_batch()] * 10, steps=10)
    assert seen == [1, 2, 3] and len(history) == 3 and trainer.stop_reason == "enough"


def test_evaluation_every_k_steps_and_at_the_end() -> None:
    trainer = _trainer(tiny_gpt(n_layer=1), track_memory=False)
    val = [token_batch(seed=9)]
    history = trainer.fit(
        [token_batch()] * 5, steps=5, eval_fn=lambda _m: trainer.evaluate(val), eval_every=2
    )
    assert [m.step for m in history if m.val_loss is not None] == [2, 4, 5]
    assert trainer.model.training


def test_progress_bar_off_when_not_a_tty(capsys) -> None:  # type: ignore[no-untyped-def]
    model = tiny_gpt(n_layer=1)
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), gpt_loss, "fp32", track_memory=False
    )
    assert not trainer.progress_enabled()
    trainer.fit([token_batch()] * 2, steps=2)
    assert capsys.readouterr().err == ""


def test_save_and_load_continue_bit_for_bit(tmp_path) -> None:
    """Dropout and the data order continue exactly after loading a saved state."""
    batches = [vector_batch(seed=s) for s in range(8)]

    def fresh() -> Trainer:
        torch.manual_seed(0)
        model = DropoutMLP()
        checkpoint(model, mode="full")
        return _trainer(model, loss_fn=mse_loss, track_memory=False)

    straight = fresh()
    expected = [m.loss for m in straight.fit(batches, steps=8)]
    first = fresh()
    first.fit(batches[:4], steps=4)
    first.save(tmp_path / "state.pt")
    torch.manual_seed(999)  # a different process would start from other RNG states
    resumed = fresh()
    resumed.load(tmp_path / "state.pt")
    assert resumed.step_count == 4
    losses = [m.loss for m in resumed.fit(batches[4:], steps=4)]
    assert losses == expected[4:]
    assert [m.step for m in resumed.history] == [5, 6, 7, 8]


def test_micro_batches_are_tracked_and_lower_the_peak() -> None:
    """MemTracker sees every micro-batch of a step; splitting the batch lowers the peak."""
    batch = token_batch(batch=8, seq=16)
    peaks = {}
    for parts in (1, 4):
        model = tiny_gpt(n_layer=1)
        reference = copy.deepcopy(model)
        trainer = _trainer(model, micro_batches=parts)
        trainer.fit([batch] * 2, steps=2)
        assert trainer.memory is not None
        peaks[parts] = trainer.memory.peak_bytes
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        assert (
            measure(reference, batch, gpt_loss, ref_opt, steps=1, micro_batches=parts).peak_bytes
            == peaks[parts]
        )
    assert peaks[4] < peaks[1]


def test_stateless_optimizer_still_gets_a_tracked_step() -> None:
    model = tiny_gpt(n_layer=1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), gpt_loss, "fp32", progress=False)
    history = trainer.fit([token_batch(batch=2, seq=8)] * 2, steps=2)
    assert [m.tracked for m in history] == [False, True] and history[1].peak_bytes
