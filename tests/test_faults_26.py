"""Issue 26: the faults a cluster and a careless hand bring, each an exit 2 with one sentence
or a run that goes on with no step lost (cases 1 and 2, the signals: test_stop_signals.py)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

import memfit
from memfit.budget import Budget
from memfit.cli.main import main
from memfit.errors import ConfigError, NonFiniteLoss
from memfit.outputs import marked_json
from memfit.records import Plan
from memfit.train import state as state_mod
from memfit.train.callbacks import SaveState, read_metrics
from memfit.train.data import BatchSampler, ByteCorpus
from memfit.train.gpt import gpt_loss
from memfit.train.state import load_state
from memfit.train.trainer import Trainer

TINY = [
    "--set", "model.n_layer=1", "--set", "model.n_embd=16", "--set", "model.n_head=2",
    "--set", "model.block_size=8", "--set", "train.batch_size=2", "--set", "data.max_bytes=20000",
]  # fmt: skip


def one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI, which must exit with 2 and print one line, no traceback; returns that line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


# -- case 3: --out replaces only a file memfit wrote ------------------------------------------


@pytest.mark.parametrize("command", ["plan", "profile"])
def test_out_refuses_a_json_object_without_the_marker(
    command: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    package = tmp_path / "package.json"
    package.write_text('{"name": "my-app", "version": "1.0.0"}\n', encoding="utf-8")
    argv = [command, *TINY, "--out", str(package), *(["--budget", "90%"] if command == "plan" else [])]
    line = one_error_line(capsys, argv)
    assert "is not a file memfit wrote (it has no 'memfit' field)" in line
    assert package.read_text(encoding="utf-8") == '{"name": "my-app", "version": "1.0.0"}\n'


def test_a_marked_plan_is_replaced_and_reads_back(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    out.write_text(marked_json("plan", Plan(blocks={}).to_dict()), encoding="utf-8")
    assert main(["plan", *TINY, "--budget", "1GiB", "--out", str(out)]) == 0
    written = json.loads(out.read_text(encoding="utf-8"))
    assert written["memfit"] == "plan" and next(iter(written)) == "memfit"
    assert Plan.from_json(out.read_text(encoding="utf-8")).budget_bytes == 2**30


def test_the_marker_is_not_a_field_of_the_record() -> None:
    plan = Plan(blocks={"a": "full"}, micro_batches=2)
    assert Plan.from_json(marked_json("plan", plan.to_dict())) == plan
    with pytest.raises(Exception, match="no field"):
        Plan.from_json(json.dumps({"memfit": 3, **plan.to_dict()}))  # a marker is a string


# -- case 8: the Python API -----------------------------------------------------------------


def _prepared(micro_batches: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer, Plan]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    plan = Plan(blocks={}, micro_batches=micro_batches)
    model, opt = memfit.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1), plan)
    return model, opt, plan


def _nan_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).mean() * float("nan")


def test_train_step_stops_on_a_nan_loss_with_the_weights_untouched() -> None:
    model, opt, plan = _prepared()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        memfit.NonFiniteLoss, match=r"the loss is nan, not finite, so this step was not taken"
    ):
        memfit.train_step(model, torch.randn(4, 4), _nan_loss, opt, plan)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    assert not opt.state  # the optimizer did not step either
    assert memfit.NonFiniteLoss is NonFiniteLoss


def test_train_step_opted_out_returns_the_nan_and_steps() -> None:
    model, opt, plan = _prepared()
    loss = memfit.train_step(model, torch.randn(4, 4), _nan_loss, opt, plan, check_finite=False)
    assert math.isnan(loss) and torch.isnan(next(model.parameters())).all()


@pytest.mark.parametrize(
    ("loss_fn", "words"),
    [
        (lambda m, b: 3, "loss_fn returned int 3, not a tensor"),
        (lambda m, b: m(b), r"loss_fn returned a tensor of shape \(4, 1\), not a scalar"),
        (lambda m, b: m(b).mean().detach(), "does not depend on the model's parameters"),
    ],
)
def test_a_loss_that_is_not_a_scalar_tensor_is_one_sentence(loss_fn: object, words: str) -> None:
    model, opt, plan = _prepared()
    with pytest.raises(ConfigError, match=words):
        memfit.train_step(model, torch.randn(4, 4), loss_fn, opt, plan)  # type: ignore[arg-type]


def test_more_micro_batches_than_rows_are_refused() -> None:
    model, opt, plan = _prepared(micro_batches=8)
    with pytest.raises(ConfigError, match="8 micro-batches cannot split a batch of 4"):
        memfit.train_step(model, torch.randn(4, 4), lambda m, b: m(b).mean(), opt, plan)


@pytest.mark.parametrize("value", [-2, 0, 10**30])
def test_plan_from_json_refuses_impossible_micro_batches(value: int) -> None:
    with pytest.raises(ConfigError, match="micro_batches must be a whole number from 1 to 2147483647, got"):
        Plan.from_json(json.dumps({"blocks": {}, "micro_batches": value}))


def test_memfit_plan_refuses_an_empty_batch_and_another_models_optimizer() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    loss = lambda m, b: m(b).mean()  # noqa: E731
    with pytest.raises(ConfigError, match=r"the batch has no rows \(its first dimension is 0\)"):
        memfit.plan(model, torch.zeros(0, 4), loss, "1GiB")
    other = torch.nn.Linear(4, 1)
    with pytest.raises(
        ConfigError, match=r"the optimizer trains 2 tensor\(s\) that are not parameters of this"
    ):
        memfit.plan(model, torch.randn(4, 4), loss, "1GiB", torch.optim.AdamW(other.parameters()))


# -- case 9: budgets in other scripts' digits or with whitespace inside ------------------------


@pytest.mark.parametrize("text", ["５MB", "٥MB", "5\nMB", "5MB\n", "5\tGiB", "6GiB\r"])
def test_budget_digits_outside_ascii_and_inner_whitespace_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match=r"its character .* is not an ASCII digit, letter, sign"):
        Budget.parse(text)
    assert Budget.parse(" 6 GiB ").bytes == 6 * 2**30  # spaces around the unit still read


def test_budget_in_other_digits_at_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_error_line(capsys, ["plan", *TINY, "--budget", "５MB"])
    assert "U+FF15" in line


# -- case 4: a save that fails for lack of memory or space --------------------------------------

_TORCH_WRITE_FAILURE = "[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs 1000"


def _fail_saves(monkeypatch: pytest.MonkeyPatch, times: int, under: Path | None = None) -> list[Path]:
    """A fault hook standing in for a save that runs out of memory (torch's own message): the
    first ``times`` saves (into ``under``, if given) fail; returns the files they aimed at."""
    real, failed = state_mod._write_signed, []

    def write(f: Any, state: dict[str, Any], key: bytes) -> None:
        target = Path(os.readlink(f"/proc/self/fd/{f.fileno()}")).parent
        if len(failed) < times and (under is None or target == under):
            failed.append(target)
            raise RuntimeError(_TORCH_WRITE_FAILURE)
        real(f, state, key)

    monkeypatch.setattr(state_mod, "_write_signed", write)
    return failed


def _gpt_trainer(out: Path) -> tuple[Trainer, BatchSampler]:
    from conftest import tiny_gpt

    sampler = BatchSampler(ByteCorpus.from_bytes(bytes(range(256)) * 40).train, 2, 8, seed=0)
    model = tiny_gpt(n_layer=1)
    saver = SaveState(out / "state.pt", every=2, data=sampler)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters()), gpt_loss, "fp32", progress=False,
                      callbacks=[saver], track_memory=False)  # fmt: skip
    return trainer, sampler


def test_a_save_that_runs_out_of_memory_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, sampler = _gpt_trainer(tmp_path)
    failed = _fail_saves(monkeypatch, times=1)
    trainer.fit(sampler, steps=4)
    assert failed == [tmp_path]  # the save of step 2 failed once, the second try worked
    assert (
        load_state(tmp_path / "state.pt")["step"] == 4 and load_state(tmp_path / "state.prev.pt")["step"] == 2
    )


def test_memfit_train_rescues_a_save_that_keeps_failing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the rescue folder, in the test's own
    _fail_saves(monkeypatch, times=2, under=out)
    argv = ["train", "--quiet", *TINY, "--set", "train.steps=4", "--set", "train.checkpoint_every=2"]
    line = one_error_line(capsys, [*argv, "--set", f"train.out='{out}'"])
    assert f"cannot write the training state {str(out / 'state.pt')!r} (the write stopped part-way" in line
    rescue = Path(line.split("was saved to ", 1)[1].split("'")[1])
    assert rescue.parent.parent == tmp_path and load_state(rescue)["step"] == 2
    assert not (out / "state.pt").exists() and [m.step for m in read_metrics(out / "metrics.jsonl")] == [1, 2]


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="RLIMIT_FSIZE is POSIX")
def test_a_real_file_size_limit_at_save_is_exit_2_not_1(tmp_path: Path) -> None:
    """No fault hook: the kernel refuses the state file's bytes (EFBIG under RLIMIT_FSIZE)."""
    import resource

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))

    out = tmp_path / "run"
    argv = ["train", "--quiet", *TINY, "--set", "train.steps=3", "--set", "train.checkpoint_every=2"]
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "memfit.cli.main", *argv, "--set", f"train.out='{out}'"],
        capture_output=True, text=True, timeout=300, env=env, preexec_fn=limit,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "nor a rescue copy; no state is on disk." in lines[0]
    assert (
        "the write stopped part-way, for lack of space or memory: [enforce fail at inline_container"
        in lines[0]
    )
    assert [m.step for m in read_metrics(out / "metrics.jsonl")] == [1, 2]  # every finished step kept
