"""A decision made once is used as it is: ``memfit plan --out p.json`` then ``memfit train CONFIG
--plan p.json`` trains with that plan without profiling or planning again, and a plan made for
another model or batch is refused in one sentence (exit code 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.cli.main import main
from memfit.records import Plan
from memfit.trainer.callbacks import read_metrics

CONFIG = """
[model]
n_layer = {layers}
n_embd = 16
n_head = 2
block_size = 16

[data]
path = "{data}"

[train]
batch_size = {batch}
steps = 3
eval_every = 3
eval_batches = 1
out = "{out}"
device = "cpu"

[memory]
checkpointing = "auto"
budget = "85%"
"""


def _config(tmp_path: Path, name: str, layers: int = 2, batch: int = 4) -> Path:
    data = tmp_path / "corpus.txt"
    if not data.exists():
        data.write_bytes(b"\n".join(p.read_bytes() for p in sorted(Path(json.__file__).parent.glob("*.py"))))
    path = tmp_path / f"{name}.toml"
    out = tmp_path / name
    path.write_text(CONFIG.format(layers=layers, batch=batch, data=data, out=out), encoding="utf-8")
    return path


def _nothing_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every way of profiling or planning fail loudly."""

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("memfit train --plan profiled or planned")

    monkeypatch.setattr("memfit.app.setup.plan", refuse)
    monkeypatch.setattr("memfit.measuring.profile.Profiler.__init__", refuse)
    monkeypatch.setattr("memfit.planning.planner._plan_batch", refuse)


def test_train_with_a_saved_plan_does_not_plan_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config, saved = _config(tmp_path, "run"), tmp_path / "p.json"
    assert main(["plan", str(config), "--out", str(saved), "--quiet"]) == 0
    plan = Plan.from_json(saved.read_text())
    assert plan.made_for is not None and plan.made_for.batch == [[4, 16], [4, 16]]
    capsys.readouterr()
    _nothing_planned(monkeypatch)
    assert main(["train", str(config), "--plan", str(saved), "--quiet"]) == 0
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m.step for m in metrics] == [1, 2, 3]
    report = (tmp_path / "run" / "report.md").read_text()
    assert "the plan given (--plan)" in report


@pytest.mark.parametrize(
    ("layers", "batch", "says"),
    [(3, 4, "the plan was made for another model"), (2, 8, "the plan was made for a batch of shape 4x16")],
)
def test_a_plan_for_another_model_or_batch_is_refused_in_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layers: int, batch: int, says: str
) -> None:
    saved = tmp_path / "p.json"
    assert main(["plan", str(_config(tmp_path, "made")), "--out", str(saved), "--quiet"]) == 0
    capsys.readouterr()
    other = _config(tmp_path, "other", layers=layers, batch=batch)
    assert main(["train", str(other), "--plan", str(saved), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "other" / "metrics.jsonl").exists()
