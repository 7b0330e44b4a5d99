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
from memfit.app.data import BatchSampler, ByteCorpus
from memfit.budget import Budget
from memfit.cli.main import main
from memfit.errors import ConfigError, NonFiniteLoss
from memfit.models.gpt import gpt_loss
from memfit.outputs import marked_json
from memfit.records import Plan
from memfit.trainer import state as state_mod
from memfit.trainer.callbacks import SaveState, read_metrics
from memfit.trainer.state import load_state
from memfit.trainer.trainer import Trainer

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


# -- case 6: reads with bounds ---------------------------------------------------------------


def test_data_max_bytes_is_read_as_a_prefix_not_the_whole_file(tmp_path: Path) -> None:
    import tracemalloc

    huge = tmp_path / "huge.txt"
    with huge.open("wb") as f:
        f.write(b"abc" * 10_000)
        f.truncate(5 * 2**30)  # a sparse 5 GiB file: reading it whole would take 5 GiB
    tracemalloc.start()
    try:
        corpus = ByteCorpus.load(huge, val_fraction=0.1, max_bytes=20_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(corpus.train) + len(corpus.val) == 20_000 and peak < 2**20


def test_a_fifo_inside_a_data_directory_is_skipped_not_waited_on(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"x" * 4000)
    os.mkfifo(tmp_path / "b.txt")
    corpus = ByteCorpus.load(tmp_path, val_fraction=0.1)
    assert len(corpus.train) + len(corpus.val) == 4000


def _cli(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI in a subprocess with a deadline: a read that blocks fails the test, not hangs it."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "memfit.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=full,
    )


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr
    # progress lines ("memfit: ...": a busy machine's slow start says so) may come first
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith("memfit: ")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_fifos_and_devices_given_as_inputs_are_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    out = ["--set", f"train.out='{tmp_path / 'out'}'"]
    line = _one_line(_cli(["train", *TINY, *out, "--set", f"data.path='{fifo}'"]))
    assert f"data path {str(fifo)!r} is a FIFO (named pipe), not a regular file" in line
    line = _one_line(_cli(["train", str(fifo), *out]))
    assert f"config file {str(fifo)!r} is a FIFO (named pipe), not a regular file" in line
    line = _one_line(_cli(["train", "/dev/zero", *out]))
    assert "config file '/dev/zero' is a character device, not a regular file" in line
    line = _one_line(_cli(["check", *TINY, "--plan", str(fifo), "--out", str(tmp_path / "c")]))
    assert f"plan file {str(fifo)!r} is a FIFO (named pipe), not a regular file" in line
    for key in ("/dev/zero", str(fifo)):
        line = _one_line(
            _cli(["train", *TINY, "--set", f"train.out='{tmp_path / 'k'}'"], {"MEMFIT_STATE_KEY": key})
        )
        assert f"the state key {key!r} is a " in line and "not a regular file" in line
        assert not (tmp_path / "k").exists()  # refused before any work


# -- case 7: input at fault, never an internal error -------------------------------------------


def test_a_deeply_nested_config_file_is_one_sentence(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    deep = tmp_path / "deep.toml"
    deep.write_text("[model]\nkwargs = { x = " + "[" * 5000 + "]" * 5000 + " }\n", encoding="utf-8")
    line = one_error_line(capsys, ["train", str(deep)])
    assert "nests tables or arrays more than 32 levels deep" in line
    deep.write_text("[model]\nkwargs = { x = " + "[" * 40 + "]" * 40 + " }\n", encoding="utf-8")
    assert "more than 32 levels deep" in one_error_line(capsys, ["train", str(deep)])


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        (f"train.batch_size={2**63 - 1}", "train.batch_size x model.block_size is 1.18e+21 tokens"),
        ("model.n_embd=10000000", "has 4.8e+15 parameters, more than any machine holds"),
        ("train.eval_batches=100000000", "train.eval_batches x train.batch_size x model.block_size"),
    ],
)
def test_sizes_no_machine_holds_are_refused(
    setting: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert words in one_error_line(capsys, ["train", "--set", setting])


def test_micro_batches_of_1e30_in_a_plan_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"memfit": "plan", "blocks": {}, "micro_batches": 10**30}), encoding="utf-8")
    line = one_error_line(capsys, ["check", *TINY, "--plan", str(plan), "--out", str(tmp_path / "c")])
    assert "micro_batches must be a whole number from 1 to 2147483647, got a number of 31 digits" in line


def test_an_output_folder_that_refuses_the_plots_keeps_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    (out / "loss.png").mkdir(parents=True)  # a real OSError when the plot is saved
    line = one_error_line(
        capsys, ["train", "--quiet", *TINY, "--set", "train.steps=2", "--set", f"train.out='{out}'"]
    )
    assert f"cannot write the plots in {str(out)!r}" in line and "metrics.jsonl and report.md" in line
    assert (
        load_state(out / "state.pt")["step"] == 2
        and "cannot write the plots" in (out / "report.md").read_text()
    )


def test_metrics_jsonl_that_became_a_directory_on_resume(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--quiet", *TINY, "--set", "train.steps=2", "--set", f"train.out='{out}'"]
    assert main(argv) == 0
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").mkdir()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert (
        "Traceback" not in err
        and f"the metrics log {str(out / 'metrics.jsonl')!r} is a directory, not a regular file" in line
    )
    assert load_state(out / "state.pt")["step"] == 2


# -- case 9: messages that name the right problem ------------------------------------------------


def test_a_long_set_value_is_not_echoed_whole(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_error_line(capsys, ["train", "--set", "train.steps=" + "a" * 5000])
    assert len(line) < 200 and "(5002 characters)" in line


def test_model_kwargs_on_the_built_in_gpt_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_error_line(capsys, ["train", "--set", "model.kwargs.preset='7b'"])
    assert "model.kwargs ('preset') goes to an 'import:' or 'hf:' model" in line


def test_a_bounded_read_allocates_what_the_file_holds_not_the_bound(tmp_path: Path) -> None:
    """A 1 TiB bound on a small file reads the file (one buffer of the bound would not fit)."""
    from memfit.reading import read_bounded

    path = tmp_path / "small.txt"
    path.write_bytes(b"x" * 3000)
    assert read_bounded(path, "a test file", 2**40) == b"x" * 3000
    assert read_bounded(path, "a test file", 1000, whole=False) == b"x" * 1000
