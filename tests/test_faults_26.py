"""Issue 26: the faults a cluster and a careless hand bring, each an exit 2 with one sentence
or a run that goes on with no step lost (cases 1 and 2, the signals: test_stop_signals.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.cli.main import main
from memfit.outputs import marked_json
from memfit.records import Plan

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
