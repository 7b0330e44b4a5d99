"""`memfit bench` end to end on a tiny built-in GPT, its files, its plot, and its errors."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from memfit.benchmarking.plot import bench_figure
from memfit.cli.main import main
from memfit.records import BenchPoint

TINY = [
    "--set", "model.n_layer=2", "--set", "model.n_embd=32", "--set", "model.n_head=2",
    "--set", "model.block_size=16", "--set", "data.max_bytes=200000", "--batch-size", "2",
    "--steps", "1",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_bench_writes_the_four_files_and_answers_a_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "b"
    code = main(
        [
            "bench",
            *TINY,
            "--strategies",
            "fp32/none,fp32/full",
            "--strategies",
            "fp32/sequential",
            "--out",
            str(out),
            "--budget",
            "97%",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "fp32/full" in text and "fp32/sequential" in text
    assert "for a budget of" in text and "the fastest measured strategy that fits is" in text
    assert {p.name for p in out.iterdir()} == {"bench.md", "bench.json", "bench.csv", "bench.png"}
    data = json.loads((out / "bench.json").read_text())
    points = [BenchPoint.from_dict(d) for d in data["points"]]
    assert [p.strategy for p in points] == ["fp32/none", "fp32/full", "fp32/sequential"]
    base = points[0].peak_bytes
    assert data["budget_bytes"] == int(0.97 * base)  # a percentage is of fp32/none's peak
    assert all(p.ok and p.peak_bytes > 0 for p in points)
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [int(r["peak_bytes"]) for r in rows] == sorted(p.peak_bytes for p in points)
    md = (out / "bench.md").read_text()
    assert "| strategy | peak bytes |" in md and "bench.png" in md and "memfit bench" in md
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_budget_below_every_strategy_says_nothing_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["bench", *TINY, "--strategies", "fp32/none,fp32/full", "--out", str(tmp_path), "--budget", "1KiB"]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "no measured strategy fits: the smallest peak seen is" in text
    smallest = min(
        BenchPoint.from_dict(d).peak_bytes
        for d in json.loads((tmp_path / "bench.json").read_text())["points"]
    )
    assert f"({smallest} bytes, fp32/full)" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategies", "fp32/nope"], "unknown strategy 'fp32/nope'"),
        (["--strategies", "bf16/fulll"], "did you mean 'bf16/full'?"),
        (["--budget", "lots"], "--budget"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--set", "model.n_layers=2"], "did you mean 'model.n_layer'?"),
    ],
)
def test_usage_errors_exit_2_with_one_line(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # nothing was run or written


def test_batch_comes_from_the_config_when_it_names_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        "[train]\nbatch_size = 3\n[model]\nn_layer = 2\nn_embd = 32\nn_head = 2\nblock_size = 16\n"
    )
    args = [
        "--set",
        "data.max_bytes=200000",
        "--steps",
        "1",
        "--strategies",
        "fp32/none",
        "--out",
        str(tmp_path),
    ]
    assert main(["bench", str(cfg), *args]) == 0
    assert ", batch 3," in capsys.readouterr().out
    cfg.write_text("[model]\nn_layer = 2\nn_embd = 32\nn_head = 2\nblock_size = 16\n")
    assert main(["bench", str(cfg), *args]) == 0
    assert ", batch 4," in capsys.readouterr().out  # the bench's own modest default


def test_out_that_is_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    assert main(["bench", "--strategies", "fp32/none", "--out", str(target)]) == 2
    assert "is a file" in capsys.readouterr().err
    assert target.read_text() == "keep me"


def test_argparse_errors_exit_2() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--steps", "many"])
    assert exc.value.code == 2


def test_list_names_every_builtin_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    names = capsys.readouterr().out.split()
    assert len(names) == 15 and "fp32/sequential" in names and "fp16/every2" in names


def _crowded() -> list[BenchPoint]:
    pts = []
    for i, prec in enumerate(("fp32", "bf16", "fp16")):
        for j, ck in enumerate(("none", "full", "every2", "sequential", "selective")):
            peak = (40 - 4 * j - 8 * i) * 2**20 + (j % 2) * 2**18
            pts.append(
                BenchPoint(
                    f"{prec}/{ck}",
                    prec,
                    ck,
                    peak_bytes=peak,
                    step_seconds=0.3 + 0.02 * j + 0.3 * i,
                    on_front=j == 0,
                )
            )
    pts.append(BenchPoint("fp16/oops", "fp16", "none", error="failed"))
    return pts


def test_plot_labels_do_not_overlap_and_axes_have_units() -> None:
    import matplotlib.pyplot as plt

    fig = bench_figure(_crowded(), budget_bytes=30 * 2**20, title="cpu")
    try:
        ax = fig.axes[0]
        assert "MiB" in ax.get_xlabel() and "ms" in ax.get_ylabel()
        renderer = fig.canvas.get_renderer()
        labels = [t for t in ax.texts if "/" in t.get_text()]
        assert sorted(t.get_text() for t in labels) == sorted(p.strategy for p in _crowded() if p.ok)
        boxes = [t.get_window_extent(renderer) for t in labels]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                overlap_w = min(a.x1, b.x1) - max(a.x0, b.x0)
                overlap_h = min(a.y1, b.y1) - max(a.y0, b.y0)
                assert overlap_w <= 0 or overlap_h <= 0, (a, b)
        assert any(line.get_label() == "Pareto front" for line in ax.get_lines())
        assert any(line.get_label().startswith("budget") for line in ax.get_lines())
    finally:
        plt.close(fig)


def test_plot_rings_the_recommendation_and_keeps_the_axis_on_the_points() -> None:
    import matplotlib.pyplot as plt

    points = _crowded()
    xs = [p.peak_bytes / 2**20 for p in points if p.ok]
    fig = bench_figure(points, budget_bytes=24 * 2**30, title="cpu")  # far above every point
    try:
        ax = fig.axes[0]
        left, right = ax.get_xlim()
        assert left <= min(xs) and max(xs) <= right < 2 * max(xs), (left, right)
        fastest = min((p for p in points if p.ok), key=lambda p: p.step_seconds)
        labels = [c.get_label() for c in ax.collections]
        assert f"recommended: {fastest.strategy}" in labels
        assert any(t.get_text().startswith("budget 24.00 GiB") for t in ax.texts)
    finally:
        plt.close(fig)
    fig = bench_figure(points, budget_bytes=30 * 2**20)  # near the points: a line, the fastest that fits
    try:
        ax = fig.axes[0]
        fits = min((p for p in points if p.ok and p.peak_bytes <= 30 * 2**20), key=lambda p: p.step_seconds)
        assert f"recommended: {fits.strategy}" in [c.get_label() for c in ax.collections]
        assert any(line.get_label().startswith("budget") for line in ax.get_lines())
    finally:
        plt.close(fig)


def test_a_percentage_budget_whose_baseline_failed_still_shows_the_rest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """First seen on an H200: fp32/none failed, and `--budget 50%` then threw away every other
    strategy's numbers at the very end. Now the failure is named and the table is kept."""
    import argparse

    from memfit.cli.bench import _budget

    failed = BenchPoint("fp32/none", "fp32", "none", baseline="fp32/none", error="ValueError: no index")
    ran = BenchPoint("bf16/full", "bf16", "full", peak_bytes=1000, baseline="fp32/none")
    assert _budget(argparse.Namespace(budget="50%"), [failed, ran]) is None
    err = capsys.readouterr().err
    assert "baseline did not run (ValueError: no index)" in err and "without a budget" in err
    assert _budget(argparse.Namespace(budget="2KiB"), [failed, ran]) == 2048  # bytes need no baseline
    ok = BenchPoint("fp32/none", "fp32", "none", peak_bytes=4000, baseline="fp32/none")
    assert _budget(argparse.Namespace(budget="50%"), [ok, ran]) == 2000
