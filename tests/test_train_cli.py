"""``memfit train``: resume after kill -9 bit for bit, files written, config errors as one sentence."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memfit.app.config import load_config
from memfit.app.run import train_from_config
from memfit.cli.main import main
from memfit.trainer.callbacks import read_metrics
from memfit.trainer.state import load_state

TESTS = Path(__file__).parent
STEPS = 20
CONFIG = """
[model]
name = "import:slow_gpt:build"
kwargs = {{ seq_len = 16, dropout = 0.1 }}
block_size = 16

[data]
path = "{data}"
val_fraction = 0.1

[train]
batch_size = 4
steps = {steps}
eval_every = 10
eval_batches = 2
checkpoint_every = 5
out = "{out}"
seed = 3

[memory]
checkpointing = "full"
"""


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    source = Path(json.__file__).parent
    path.write_bytes(b"\n".join(p.read_bytes() for p in sorted(source.glob("*.py"))))
    return path


def _config(tmp_path: Path, data: Path, out: Path) -> Path:
    path = tmp_path / f"{out.name}.toml"
    path.write_text(CONFIG.format(data=data, out=out, steps=STEPS), encoding="utf-8")
    return path


def _env() -> dict[str, str]:
    # NOTE: one thread: fast for this tiny model on a busy machine, and the same thread count
    # as the in-process reference run, so CPU reductions add up in the same order.
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def _wait_for_checkpoint(proc: subprocess.Popen, out: Path, timeout: float = 120.0) -> None:  # type: ignore[type-arg]
    """Wait until a state was saved and training went on past it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the training process ended before it could be killed"
        metrics = read_metrics(out / "metrics.jsonl")
        if (out / "state.pt").exists() and metrics and metrics[-1].step >= 7:
            return
        time.sleep(0.02)
    raise AssertionError("no checkpoint was written in time")


@pytest.mark.slow
def test_kill_9_then_resume_gives_the_same_losses_bit_for_bit(tmp_path, text_file, monkeypatch) -> None:
    killed_out = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "memfit.cli.main",
        "train",
        str(_config(tmp_path, text_file, killed_out)),
        "--quiet",
    ]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for_checkpoint(proc, killed_out)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    saved_step = load_state(killed_out / "state.pt")["step"]
    before = read_metrics(killed_out / "metrics.jsonl")
    assert 5 <= saved_step < STEPS and before[-1].step < STEPS  # killed in the middle

    resumed = subprocess.run([*cmd, "--resume"], env=_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at step {saved_step}" not in resumed.stdout  # --quiet prints nothing
    assert resumed.stdout == ""

    # the uninterrupted run of the same config, in this process
    monkeypatch.syspath_prepend(str(TESTS))
    straight_out = tmp_path / "straight"
    cfg = load_config(_config(tmp_path, text_file, straight_out))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        straight = train_from_config(cfg, progress=False, echo=lambda _line: None)
    finally:
        torch.set_num_threads(threads)

    got = read_metrics(killed_out / "metrics.jsonl")
    assert [m.step for m in got] == list(range(1, STEPS + 1))
    assert [m.loss for m in got] == [m.loss for m in straight.history]  # bit for bit
    assert [m.val_loss for m in got] == [m.val_loss for m in straight.history]
    final_a, final_b = load_state(killed_out / "state.pt"), load_state(straight_out / "state.pt")
    assert final_a["step"] == final_b["step"] == STEPS
    for key, value in final_b["model"].items():
        torch.testing.assert_close(final_a["model"][key], value, rtol=0, atol=0, msg=key)
    report = (killed_out / "report.md").read_text()
    assert f"resumed from {killed_out / 'state.pt'} at step {saved_step}" in report


@pytest.mark.slow
def test_ctrl_c_stops_after_the_step_and_saves_it(tmp_path, text_file) -> None:
    out = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "memfit.cli.main", "train", str(_config(tmp_path, text_file, out))]
    # Ctrl-C as a terminal delivers it, even where this test runs in the background (a shell
    # then starts its children with SIGINT ignored, which memfit train leaves as it is)
    default = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    proc = subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default
    )
    try:
        _wait_for_checkpoint(proc, out)
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "stopping after this step" in stdout
    steps = [m.step for m in read_metrics(out / "metrics.jsonl")]
    assert steps[-1] < STEPS and steps == list(range(1, steps[-1] + 1))
    assert load_state(out / "state.pt")["step"] == steps[-1]  # the last finished step was saved
    assert "stopped early: interrupted (Ctrl-C)" in (out / "report.md").read_text()


def _error(capsys, argv: list[str]) -> str:  # type: ignore[no-untyped-def]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def test_unknown_key_names_the_closest_valid_one(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nbatch_sise = 4\n")
    line = _error(capsys, ["train", str(cfg)])
    assert "'train.batch_sise'" in line and "did you mean 'train.batch_size'" in line


def test_wrong_type_is_named(capsys) -> None:  # type: ignore[no-untyped-def]
    line = _error(capsys, ["train", "--set", "train.steps='many'"])
    assert "train.steps must be int" in line and "'many'" in line


def test_missing_data_path(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    missing = tmp_path / "no-such-corpus"
    line = _error(capsys, ["train", "--set", f"data.path='{missing}'", "--set", f"train.out='{tmp_path}'"])
    assert "does not exist" in line and str(missing) in line and "data.path" in line


def test_unparsable_budget(capsys) -> None:  # type: ignore[no-untyped-def]
    line = _error(capsys, ["train", "--set", "memory.budget='lots'"])
    assert "cannot read memory.budget 'lots'" in line and "GiB" in line


def test_model_factory_that_cannot_be_imported(capsys, tmp_path, text_file) -> None:  # type: ignore[no-untyped-def]
    argv = [
        "train",
        "--set",
        "model.name='import:no_such_pkg.models:build'",
        "--set",
        f"data.path='{text_file}'",
    ]
    line = _error(capsys, [*argv, "--set", f"train.out='{tmp_path}'"])
    assert "cannot import module 'no_such_pkg.models'" in line


def test_checkpointing_auto_plans_to_the_budget(capsys, tmp_path, text_file) -> None:  # type: ignore[no-untyped-def]
    argv = [
        "train",
        "--set", "model.n_layer=2", "--set", "model.n_embd=16", "--set", "model.n_head=2",
        "--set", "model.block_size=16", "--set", "train.steps=2", "--set", "train.batch_size=4",
        "--set", f"data.path='{text_file}'", "--set", "memory.checkpointing='auto'",
    ]  # fmt: skip
    assert main([*argv, "--set", "memory.budget='80%'", "--set", f"train.out='{tmp_path / 'a'}'"]) == 0
    assert "planned to" in capsys.readouterr().out
    line = _error(capsys, [*argv, "--set", "memory.budget='1KB'", "--set", f"train.out='{tmp_path / 'b'}'"])
    assert "no plan fits the budget" in line and "AdamW state alone take" in line


def test_resume_refuses_a_truncated_state_and_names_the_previous(capsys, tmp_path, text_file) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    argv = [
        "train",
        "--quiet",
        "--set", "model.n_layer=1", "--set", "model.n_embd=16", "--set", "model.n_head=2",
        "--set", "model.block_size=8", "--set", "train.steps=4", "--set", "train.checkpoint_every=2",
        "--set", f"data.path='{text_file}'", "--set", f"train.out='{out}'",
    ]  # fmt: skip
    assert main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "loss.png",
        "memory.png",
        "metrics.jsonl",
        "report.md",
        "state.prev.pt",
        "state.pt",
    ]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
    state = out / "state.pt"
    with state.open("r+b") as f:
        f.truncate(state.stat().st_size - 10)
    line = _error(capsys, [*argv, "--resume"])
    assert "truncated" in line and "state.prev.pt" in line
    config = tmp_path / "run.toml"
    config.write_text(f"[train]\nout = '{out}'\n")
    line = _error(capsys, ["train", "--resume", str(config)])  # the config is not taken for a state
    assert "truncated" in line
    assert load_state(out / "state.prev.pt")["step"] == 2
    assert main([*argv, "--resume", str(out / "state.prev.pt"), "--set", "train.steps=5"]) == 0
    assert [m.step for m in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_resume_refuses_a_different_run(capsys, tmp_path, text_file) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    argv = [
        "train", "--quiet", "--set", "model.n_layer=1", "--set", "model.n_embd=16", "--set", "model.n_head=2",
        "--set", "model.block_size=8", "--set", "train.steps=2", "--set", f"data.path='{text_file}'",
        "--set", f"train.out='{out}'",
    ]  # fmt: skip
    assert main(argv) == 0
    line = _error(capsys, [*argv, "--resume", "--set", "optimizer.lr=0.01"])
    assert "optimizer.lr" in line and "0.001" in line
    line = _error(capsys, [*argv, "--resume", "--set", "model.n_embd=32", "--set", "model.n_head=2"])
    assert "model.n_embd = 16" in line and "32" in line


def test_example_config_loads() -> None:
    cfg = load_config(TESTS.parent / "examples" / "gpt.toml")
    assert cfg.memory.checkpointing == "full" and cfg.optimizer.schedule == "cosine"


def test_budget_verdict_in_the_report(tmp_path, text_file, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "run"
    argv = [
        "train", "--quiet", "--set", "model.n_layer=1", "--set", "model.n_embd=16", "--set", "model.n_head=2",
        "--set", "model.block_size=8", "--set", "train.steps=2", "--set", f"data.path='{text_file}'",
        "--set", f"train.out='{out}'", "--set", "memory.budget='1KB'", "--set", "model.n_layer=3",
        "--set", "memory.checkpointing='every:2'",
    ]  # fmt: skip
    assert main(argv) == 0
    assert "is OVER memory.budget" in capsys.readouterr().err
    report = (out / "report.md").read_text()
    assert "OVER memory.budget" in report
    assert "| checkpointing | full on every 2 blocks (blocks.0, blocks.2) |" in report
    peak = next(m.peak_bytes for m in read_metrics(out / "metrics.jsonl") if m.tracked)
    assert peak is not None and f"{peak:,}" in report
    for name in ("loss.png", "memory.png"):  # plots as the demo draws them, shown in the report
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"({name})" in report
