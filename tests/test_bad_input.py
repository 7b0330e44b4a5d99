"""Issue 15: every bad input is one sentence and exit code 2, checked before any work; none
is a traceback. Cases 2, 3 and 6 of the issue, run as a user would type them."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

import memfit
from memfit.app.config import load_config
from memfit.budget import parse_bytes
from memfit.cli.main import main
from memfit.errors import ConfigError
from memfit.trainer.callbacks import read_metrics

TINY = [
    "--set", "model.n_layer=2", "--set", "model.n_embd=16", "--set", "model.n_head=2",
    "--set", "model.block_size=8", "--set", "train.batch_size=4", "--set", "data.max_bytes=20000",
]  # fmt: skip
NINES = "9" * 400


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI; it must exit 2 with exactly one line on stderr and no traceback."""
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


# -- case 2: values that passed validation and then failed with a traceback -------------


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("optimizer.lr=nan", "optimizer.lr must be a finite number above 0, got nan"),
        ("train.seed=-1", "train.seed must be an integer from 0 to 4294967295, got -1"),
        ("train.seed=1e20", "train.seed must be int"),
        ("train.seed=100000000000000000000", "train.seed is too large"),
        ("optimizer.eps=-1", "optimizer.eps must be a finite number at least 0"),
        ("optimizer.weight_decay=nan", "optimizer.weight_decay must be a finite number at least 0"),
        (f"memory.budget='{NINES}'", "is too large to be a memory size"),
    ],
)
def test_values_torch_would_refuse_are_refused_first(
    setting: str, expected: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    line = _error(capsys, ["train", *TINY, "--set", setting, "--set", f"train.out='{tmp_path / 'o'}'"])
    assert expected in line
    assert not (tmp_path / "o").exists()


def test_cuda_on_a_torch_without_cuda(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for command in (["train"], ["plan", "--budget", "1GiB"], ["profile"], ["bench"], ["check"]):
        argv = [*command, *TINY, "--set", "train.device='cuda'", "--set", f"train.out='{tmp_path / 'o'}'"]
        line = _error(capsys, argv)
        assert "train.device is 'cuda'" in line and "use 'cpu' or 'auto'" in line


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--budget", NINES],
        ["estimate", "--device-memory", NINES],
        ["profile", "--device-memory", NINES],
        ["bench", "--budget", NINES],
        ["train", "--set", "memory.checkpointing='auto'", "--set", f"memory.budget='{NINES}'"],
    ],
)
def test_a_budget_of_400_nines(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(capsys, [*argv, *TINY])
    assert "too large" in line and "characters" in line  # the value is shortened, not printed whole


def test_parse_bytes_keeps_its_promise_of_more_than_zero() -> None:
    for value in (5.96e-08, 0.5, "0.3B", "1e-9"):
        with pytest.raises(ConfigError):
            parse_bytes(value)
    assert parse_bytes(1.5) == 1 and parse_bytes(2000000) == 2000000


@pytest.mark.parametrize("text", ["[]", '{"blocks": 5}', '{"blocks": {"blocks.0": 3}}', "{", '"plan"'])
def test_plan_files_that_are_not_plans(text: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(text)
    line = _error(capsys, ["check", *TINY, "--plan", str(plan), "--out", str(tmp_path / "c")])
    assert f"plan file {str(plan)!r} is not a memfit plan" in line
    with pytest.raises(ConfigError):
        memfit.Plan.from_json(text)


def test_an_unreadable_config_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[train]\nsteps = 2\n")
    import memfit.reading

    real_open = os.open

    def denied(path: object, *args: int) -> int:  # NOTE: chmod 000 does not stop root
        if Path(str(path)) == config:
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(memfit.reading.os, "open", denied)
    line = _error(capsys, ["train", str(config)])
    assert f"cannot read config file {str(config)!r} (Permission denied)" in line


# -- case 3: output paths are checked before the work -------------------------------------


@pytest.mark.parametrize("command", [["plan", "--budget", "90%"], ["profile"]])
def test_out_that_is_a_directory_or_unwritable_is_refused_first(
    command: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("memfit.cli.model_args.build_model", _refuse)
    line = _error(capsys, [*command, *TINY, "--out", str(tmp_path)])
    assert "--out" in line and "is a directory" in line
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    line = _error(capsys, [*command, *TINY, "--out", str(blocker / "plan.json")])
    assert "which is a file" in line and blocker.read_text() == "keep me"
    _read_only(monkeypatch, tmp_path / "ro")
    line = _error(capsys, [*command, *TINY, "--out", str(tmp_path / "ro" / "x.json")])
    assert "is not writable" in line


def test_check_out_and_train_out_naming_a_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    monkeypatch.setattr("memfit.cli.check.build_model", _refuse)
    monkeypatch.setattr("memfit.app.setup.build_model", _refuse)
    line = _error(capsys, ["check", *TINY, "--out", str(target)])
    assert "--out" in line and "is a file" in line
    line = _error(capsys, ["train", *TINY, "--set", f"train.out='{target}'"])
    assert "train.out" in line and "is a file" in line
    assert target.read_text() == "keep me"


def _refuse(*args: object, **kwargs: object) -> object:
    raise AssertionError("the work started before the input was checked")


def _read_only(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """Make ``directory`` refuse new files (a fault hook: chmod does not stop root)."""
    import tempfile

    directory.mkdir()
    real = tempfile.TemporaryFile

    def temporary(*args: object, **kwargs: object) -> object:
        if Path(str(kwargs.get("dir", ""))) == directory:
            raise PermissionError(13, "Permission denied")
        return real(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(tempfile, "TemporaryFile", temporary)


# -- case 6: smaller ------------------------------------------------------------------------


def test_a_plan_for_a_smaller_model_is_refused_by_check(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plan = tmp_path / "plan.json"
    assert main(["plan", *TINY, "--budget", "90%", "--no-check", "--out", str(plan)]) == 0
    assert set(json.loads(plan.read_text())["blocks"]) == {"blocks.0", "blocks.1"}
    capsys.readouterr()
    line = _error(
        capsys, ["check", *TINY, "--set", "model.n_layer=3", "--plan", str(plan), "--out", str(tmp_path)]
    )
    assert "the plan was made for another model: GPT with 10,816 parameters, this is GPT with 14,096" in line
    # a plan.json of an older memfit (flat, no made_for) is refused by the blocks it leaves out
    old = json.loads(plan.read_text())
    flat = {**{k: v for k, v in old.items() if k not in ("report", "made_for")}, **old["report"]}
    plan.write_text(json.dumps(flat))
    line = _error(
        capsys, ["check", *TINY, "--set", "model.n_layer=3", "--plan", str(plan), "--out", str(tmp_path)]
    )
    assert "covers 2 of the 3 blocks" in line and "'blocks.2'" in line


def test_a_directory_given_as_the_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = _error(capsys, ["train", str(tmp_path)])
    assert "is a directory" in line and "does not exist" not in line


def test_a_budget_in_bytes_as_an_integer(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[memory]\nbudget = 2000000\ncheckpointing = "auto"\n')
    cfg = load_config(config)
    assert cfg.memory.budget == "2000000" and parse_bytes(cfg.memory.budget) == 2_000_000


@pytest.mark.parametrize("argv", [["plan", "--budget", "-1GB"], ["estimate", "--device-memory", "-2GiB"]])
def test_a_negative_budget_reaches_its_check(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(capsys, [*argv, *TINY])
    assert "must be positive" in line and "-" in line


def test_argparse_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--steps-typo", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memfit: error: unrecognized arguments")


def test_unexpected_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("memfit.cli.doctor.doctor_facts", lambda: {}["boom"])
    assert main(["doctor"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "internal error: KeyError" in err[0] and "MEMFIT_TRACEBACK=1" in err[0]


def test_the_recovery_hint_runs_as_printed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["train", "--quiet", *TINY, "--set", "train.steps=4", "--set", "train.checkpoint_every=2",
            "--set", f"train.out='{out}'"]  # fmt: skip
    assert main(argv) == 0
    state = out / "state.pt"
    state.write_bytes(state.read_bytes()[:-10])
    line = _error(capsys, [*argv, "--resume"])
    hint = line[line.index("(memfit train --resume ") + 1 : line.rindex(")")]
    assert main([*shlex.split(hint)[1:], "--quiet"]) == 0  # as printed, no config file needed
    assert [m.step for m in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]


def test_resume_says_what_changed_and_keeps_the_saved_config_without_a_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(
        "[model]\nn_layer = 2\nn_embd = 16\nn_head = 2\nblock_size = 8\n[data]\nmax_bytes = 20000\n"
        f'[train]\nbatch_size = 4\nsteps = 8\ncheckpoint_every = 2\nout = "{out}"\n'
        '[optimizer]\nschedule = "cosine"\n[memory]\ncheckpointing = "full"\n'
    )
    assert main(["train", str(config), "--quiet", "--set", "memory.checkpointing='selective'", "--set",
                 "train.steps=4"]) == 0  # fmt: skip
    capsys.readouterr()
    # without the config file: the saved run's settings, changed only by --set
    assert main(["train", "--quiet", "--resume", str(out / "state.pt"), "--set", "train.steps=6"]) == 0
    err = capsys.readouterr().err
    assert "train.steps is 6 now; the saved run used 4" in err
    assert "changes the cosine learning-rate schedule" in err and "memory.checkpointing" not in err
    assert "| checkpointing | selective |" in (out / "report.md").read_text()
    # with the config file: its settings, and every difference from the saved run is named
    assert main(["train", str(config), "--quiet", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "memory.checkpointing is 'full' now; the saved run used 'selective'" in err
    assert "repeat an earlier --set to keep it" in err
    report = (out / "report.md").read_text()
    assert "memory.checkpointing is 'full' now" in report and "learning rate" in report


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model.kwargs=5", "model.kwargs.preset='7b'"], "model.kwargs is a int, not a table"),
        (["model.kwargs.=3"], "must name an argument"),
    ],
)
def test_model_kwargs_overrides_that_cannot_be_applied(overrides: list[str], words: str) -> None:
    # NOTE: found by tests/test_fuzz.py (a TypeError escaped before).
    with pytest.raises(ConfigError, match=words):
        load_config(None, overrides)


def test_out_naming_a_file_memfit_did_not_write_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # NOTE: `memfit plan --out /etc/passwd` run as root replaced the system's user list once.
    precious = tmp_path / "notes.txt"
    precious.write_text("root:x:0:0:root:/root:/bin/bash\n", encoding="utf-8")
    argv = ["plan", "--set", "model.n_layer=2", "--set", "model.n_embd=16", "--set", "model.n_head=2"]
    assert main([*argv, "--set", "model.block_size=16", "--budget", "90%", "--out", str(precious)]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a file memfit wrote" in err and err.count("\n") == 1
    assert precious.read_text(encoding="utf-8") == "root:x:0:0:root:/root:/bin/bash\n"
    own = tmp_path / "plan.json"
    own.write_text('{"memfit": "plan", "blocks": {}}', encoding="utf-8")  # an earlier plan is replaced
    assert main([*argv, "--set", "model.block_size=16", "--budget", "90%", "--out", str(own)]) == 0
    written = json.loads(own.read_text(encoding="utf-8"))
    assert written["memfit"] == "plan" and written["blocks"]
