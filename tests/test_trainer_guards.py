"""The guards inside the Trainer: stop with attribution and a resumable last good state; fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from check_models import loud_mlp, mse, vector_batches
from conftest import tiny_gpt

from memfit.app.config import load_config
from memfit.app.data import BatchSampler, ByteCorpus
from memfit.app.run import train_from_config
from memfit.check.guards import GuardConfig
from memfit.errors import NonFiniteLoss
from memfit.models.gpt import gpt_loss
from memfit.records import StepMetrics
from memfit.trainer.callbacks import Callback, SaveState, read_metrics
from memfit.trainer.trainer import Trainer


def _sampler() -> BatchSampler:
    corpus = ByteCorpus.from_bytes(bytes(range(256)) * 40)
    return BatchSampler(corpus.train, batch_size=3, seq_len=16, seed=0)


class _Weights(Callback):
    def __init__(self) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, trainer: Trainer, metrics: StepMetrics) -> None:
        self.after[metrics.step] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_nan_in_a_block_stops_the_trainer_and_the_last_good_state_resumes(tmp_path: Path) -> None:
    model = tiny_gpt(n_layer=3)
    weights = _Weights()
    sampler = _sampler()
    saver = SaveState(tmp_path / "state.pt", every=1, data=sampler)
    trainer = Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), gpt_loss, "fp32",
        callbacks=[saver, weights], progress=False, track_memory=False,
    )  # fmt: skip

    def inject(module: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor | None:
        return out * float("nan") if trainer.step_count == 2 else None  # while step 3 runs

    model.blocks[1].register_forward_hook(inject)
    with pytest.raises(NonFiniteLoss) as info:
        trainer.fit(sampler, steps=6)
    err = info.value
    assert err.attribution is not None
    assert (err.attribution.module, err.attribution.phase) == ("blocks.1", "forward")
    assert err.state_path == tmp_path / "last-good.pt" and err.state_path.exists()
    assert "stopped at step 3" in str(err) and "'blocks.1'" in str(err)
    assert [e.kind for e in trainer.guard.events] == ["stop"]

    fresh = tiny_gpt(n_layer=3)
    resumed_sampler = _sampler()
    resumed = Trainer(
        fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3), gpt_loss, "fp32",
        progress=False, track_memory=False,
    )  # fmt: skip
    resumed.load(err.state_path, data=resumed_sampler)
    assert resumed.step_count == 2
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, weights.after[2][key], rtol=0, atol=0)
    assert resumed_sampler.position == 3  # the failed batch is skipped
    history = resumed.fit(resumed_sampler, steps=4)
    assert [m.step for m in history] == [3, 4, 5, 6]
    assert all(torch.isfinite(torch.tensor([m.loss for m in history])))


def test_fp16_overflow_falls_back_and_training_completes(caplog: pytest.LogCaptureFixture) -> None:
    model = loud_mlp()
    trainer = Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), mse, "fp16",
        guard=GuardConfig(on_overflow="fallback"), progress=False, track_memory=False,
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="memfit.guard"):
        history = trainer.fit(vector_batches(5), steps=5)
    assert len(history) == 5 and all(torch.isfinite(torch.tensor([m.loss for m in history])))
    assert trainer.precision.mode == "bf16"
    assert "step 1: loss is " in caplog.text
    assert "fp16 -> bf16 from step 1" in caplog.text and "'body.1'" in caplog.text


def _grad_overflow(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A finite loss whose gradients overflow fp16 at any loss scale (the scaler's case)."""
    return mse(model, batch) * 1e30


def test_without_fallback_fp16_overflow_only_warns() -> None:
    # NOTE: issue 15: a gradient overflow is the scaler's business (it skips and warns); a
    # non-finite forward pass stops instead, see the test below.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    trainer = Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), _grad_overflow, "fp16",
        guard=GuardConfig(window=4), progress=False, track_memory=False,
    )  # fmt: skip
    history = trainer.fit(vector_batches(6), steps=6)
    assert all(m.skipped for m in history) and trainer.precision.mode == "fp16"
    assert [e.kind for e in trainer.guard.events] == ["warning"]


def test_fp16_forward_overflow_stops_like_fp32_and_keeps_the_last_good_state(tmp_path: Path) -> None:
    """Issue 15: a non-finite fp16 forward pass is not reported as success: it stops at once,
    names the module and keeps the state from before the step."""
    model = loud_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), mse, "fp16",
        progress=False, track_memory=False, last_good_path=tmp_path / "last-good.pt",
    )  # fmt: skip
    with pytest.raises(NonFiniteLoss) as info:
        trainer.fit(vector_batches(6), steps=6)
    err = info.value
    assert err.attribution is not None and err.attribution.module == "body.1"
    assert err.attribution.phase == "forward" and "fp16 training stopped at step 1" in str(err)
    assert err.state_path == tmp_path / "last-good.pt" and err.state_path.exists()
    assert trainer.history == [] and [e.kind for e in trainer.guard.events] == ["stop"]
    fresh = loud_mlp()
    Trainer(fresh, torch.optim.AdamW(fresh.parameters()), mse, "fp16", progress=False).load(err.state_path)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_memfit_train_config_fallback_is_logged_in_the_report(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "model.name='import:check_models:loud_spec'",
            "memory.precision='fp16'",
            "memory.on_overflow='fallback'",
            "train.steps=4",
            "train.batch_size=4",
            "train.eval_every=0",
            "train.eval_batches=1",
            f"train.out='{tmp_path}'",
        ],
    )
    lines: list[str] = []
    run = train_from_config(cfg, progress=False, echo=lines.append)
    assert len(run.history) == 4 and run.trainer.precision.mode == "bf16"
    report = (tmp_path / "report.md").read_text()
    assert "guard, step 1" in report and "fp16 -> bf16" in report


class _NoHooks(Callback):
    def __init__(self) -> None:
        self.seen = 0

    def on_step_end(self, trainer: Trainer, metrics: StepMetrics) -> None:
        for module in trainer.model.modules():
            assert not module._forward_hooks and not module._backward_hooks
            self.seen += 1


def test_normal_training_installs_no_hooks() -> None:
    model = tiny_gpt()
    probe = _NoHooks()
    trainer = Trainer(
        model, torch.optim.AdamW(model.parameters()), gpt_loss, "bf16",
        callbacks=[probe], progress=False, track_memory=False,
    )  # fmt: skip
    trainer.fit(_sampler(), steps=2)
    assert probe.seen > 0 and trainer.guard.events == []


def test_memfit_train_stops_with_exit_2_and_resumes_from_last_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from memfit.cli.main import main

    out = tmp_path / "out"
    args = [
        "train",
        *("--set", "model.name='import:check_models:nan_gpt'", "--set", "model.block_size=16"),
        *("--set", "train.steps=6", "--set", "train.batch_size=2", "--set", "train.checkpoint_every=2"),
        *("--set", "data.max_bytes=100000", "--set", "train.eval_every=0", "--set", f"train.out='{out}'"),
        "--quiet",
    ]
    monkeypatch.setenv("MEMFIT_TEST_NAN_AT", "4")
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopped at step 4" in err[0] and "'blocks.1'" in err[0] and "forward" in err[0]
    assert (out / "last-good.pt").exists()
    monkeypatch.setenv("MEMFIT_TEST_NAN_AT", "0")
    assert main([*args, "--resume", str(out / "last-good.pt")]) == 0
    steps = [m.step for m in read_metrics(out / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]
