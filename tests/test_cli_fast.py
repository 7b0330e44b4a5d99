"""Issue 28: quick answers without torch, --quiet everywhere, advice that follows the device, honest words."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import memfit
from memfit.cli.advice import bench_advice, speed_order
from memfit.cli.common import zero_grads_note
from memfit.cli.main import _parser, main
from memfit.devices import DeviceFacts, recommendation_line, slow_precisions
from memfit.errors import InfeasibleBudget
from memfit.records import BenchPoint, EstimateEntry, Plan, PlanReport
from memfit.vocab import PRECISION_CHOICES, PRECISIONS

SRC = Path(__file__).resolve().parents[1] / "src"
TINY = ["--set", "model.n_layer=2", "--set", "model.n_embd=16", "--set", "model.n_head=2"]
TINY += ["--set", "model.block_size=8", "--set", "train.batch_size=2"]


def _facts(native: bool) -> DeviceFacts:
    return DeviceFacts("cpu", "cpu", "a CPU", 2**30, bf16_runs=True, bf16_native=native)


def _imports(argv: list[str]) -> tuple[int, str, set[str]]:
    """Exit code, stderr without the import lines, and every module imported, of ``memfit ARGV``."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONPROFILEIMPORTTIME": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "memfit", *argv], capture_output=True, text=True, env=env, timeout=120
    )
    lines = done.stderr.splitlines()
    modules = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    rest = "\n".join(line for line in lines if not line.startswith("import time:"))
    return done.returncode, rest, modules


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--help"], 0),
        (["--version"], 0),
        (["plan", "--help"], 0),
        (["bench", "--help"], 0),
        (["plan", "--bogus"], 2),
    ],
)
def test_help_version_and_argument_errors_import_no_torch(argv: list[str], code: int) -> None:
    returncode, err, modules = _imports(argv)
    assert returncode == code, err
    assert "memfit.cli.arguments" in modules  # the import profile was read
    assert not {m for m in modules if m.split(".")[0] == "torch"}
    assert "memfit.cli.plan" not in modules
    if code == 2:
        assert err.strip() == "memfit: error: unrecognized arguments: --bogus (see memfit --help)"


def test_the_top_level_names_are_lazy_and_all_there() -> None:
    from memfit import plan

    assert plan is memfit.plan and callable(plan)
    importlib.import_module("memfit.applying.apply_plan")  # importing its module leaves the name as it is

    assert callable(memfit.apply) and memfit.apply.__module__ == "memfit.applying.apply_plan"
    # no top-level name is also a module or package of memfit (See Note [the lazy top level])
    src = Path(memfit.__file__).parent
    assert not [n for n in memfit.__all__ if (src / f"{n}.py").exists() or (src / n).is_dir()]
    assert set(memfit.__all__) <= set(dir(memfit))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        memfit.nothing_here  # noqa: B018


def test_help_names_the_choices_that_memfit_vocab_holds() -> None:
    sub = next(a for a in _parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    choices = sub.choices  # type: ignore[attr-defined]

    def words(names: tuple[str, ...]) -> str:
        return ", ".join(names[:-1]) + " or " + names[-1]

    assert words(PRECISION_CHOICES) in choices["plan"].format_help().replace("\n", " ").replace("  ", " ")
    assert words(PRECISION_CHOICES) in choices["profile"].format_help().replace("\n", " ")
    assert words(PRECISIONS) in choices["estimate"].format_help().replace("\n", " ")
    assert "--budget 60%|6GiB|device" in choices["plan"].format_help()


def test_a_bad_choice_is_one_sentence_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["plan", "--precision", "fp8"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "memfit: error: argument --precision: invalid choice 'fp8' (choose from "
        f"{', '.join(PRECISION_CHOICES)}) (see memfit plan --help)"
    )


@pytest.mark.parametrize("command", ["plan", "check", "bench", "estimate", "profile", "train", "demo"])
def test_quiet_sets_memfit_quiet_while_the_command_runs(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str | None] = []
    monkeypatch.delenv("MEMFIT_QUIET", raising=False)
    monkeypatch.setattr(f"memfit.cli.{command}.check", lambda args: None)
    monkeypatch.setattr(
        f"memfit.cli.{command}.run", lambda args: seen.append(os.environ.get("MEMFIT_QUIET")) or 0
    )
    assert main([command, "--quiet"]) == 0
    assert main([command]) == 0
    assert seen == ["1", None] and "MEMFIT_QUIET" not in os.environ


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        # Issue 37: the budget "5 potatoes" split in two by the shell is named as the budget
        (["plan", "--budget", "5", "potatoes"], "cannot read --budget '5 potatoes': write bytes as"),
        (["plan", "--budget", "5", "GiB"], "--budget '5 GiB' is two words on the command line, so 'GiB'"),
        (["estimate", "--device-memory", "80", "GiB"], "--device-memory '80 GiB' is two words"),
        (["plan", "--budget", "5", "missing.toml"], "config file 'missing.toml' does not exist; give"),
        (["plan", "--budget", "60 potatoes"], "cannot read --budget '60 potatoes'"),
        (["bench", "--budget", "150%"], "--budget '150%' is over 100% of the baseline peak"),
        (["train", "missing.toml"], "config file 'missing.toml' does not exist"),
        (["plan", "--out", "{file}/plan.json"], "is inside"),
        (["demo", "--out", "{file}"], "is a file; give a directory"),
    ],
)
def test_paths_budgets_and_out_are_checked_before_torch(argv: list[str], said: str, tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    returncode, err, modules = _imports([word.format(file=a_file) for word in argv])
    assert returncode == 2, err
    assert err.startswith(f"memfit {argv[0]}: error: ") and said in err, err
    assert len(err.strip().splitlines()) == 1, err  # one sentence, no traceback
    assert "memfit.cli.inputs" in modules  # the import profile was read
    assert not {m for m in modules if m.split(".")[0] == "torch"}


def test_the_budget_is_parsed_once_and_handed_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from memfit.budget import Budget

    seen: list[object] = []
    monkeypatch.setattr("memfit.cli.plan.check", lambda args: seen.append(args.budget))
    monkeypatch.setattr("memfit.cli.plan.run", lambda args: seen.append(args.budget) or 0)
    assert main(["plan", "--budget", "60%", "--out", str(tmp_path / "plan.json")]) == 0
    assert seen == [Budget.parse("60%")] * 2 and seen[0] is seen[1]


def _points(bf16_seconds: float) -> list[BenchPoint]:
    def point(precision: str, mode: str, peak: int, seconds: float) -> BenchPoint:
        return BenchPoint(
            f"{precision}/{mode}", precision, mode, peak_bytes=peak, step_seconds=seconds,
            time_ratio=seconds, peak_ratio=peak / 100, baseline="fp32/none",
        )  # fmt: skip

    return [
        point("fp32", "none", 100, 1.0),
        point("fp32", "full", 70, 1.3),
        point("bf16", "none", 55, bf16_seconds),
        point("bf16", "full", 40, bf16_seconds * 1.3),
    ]


def test_bench_recommends_bf16_only_where_it_is_native_and_measured_faster() -> None:
    assert "fits is bf16/none" in bench_advice(_points(0.5), 60, _facts(native=True))
    emulated = bench_advice(_points(0.5), 60, _facts(native=False))
    # Issue 37: what fits is named first (it was "no measured strategy fits", then bf16 "for memory only")
    assert emulated.startswith(
        "for a budget of 60 B (60 bytes), the fastest measured strategy that fits is bf16/none"
    )
    assert "bf16 is not native on cpu" in emulated and "it saves memory, not time" in emulated
    assert "none of the strategies fast here fits (the smallest is fp32/full, peak 70 B)" in emulated
    assert "no measured strategy fits" not in emulated
    slower = bench_advice(_points(9.19), 80, _facts(native=True))
    assert "fits is fp32/full" in slower and "bf16 measured 9.19x the step time of fp32/none" in slower
    assert "For memory only" not in slower  # fp32/full fits: bf16 is not named for memory


def test_the_bench_command_reads_the_device_facts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from memfit.cli import bench

    for native, says in ((False, "fits is fp32/full"), (True, "fits is bf16/none")):
        monkeypatch.setattr(bench, "device_facts", lambda _d, native=native: _facts(native))
        bench._print_points(_points(0.5), 80, "heading", torch.device("cpu"))
        assert says in capsys.readouterr().out


@pytest.mark.parametrize("native", [False, True])
def test_estimate_puts_emulated_precisions_after_fp32(
    native: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("memfit.cli.estimate.device_facts", lambda _d: _facts(native))
    assert (
        main(["estimate", *TINY, "--precision", "fp32", "--precision", "bf16", "--device-memory", "1GiB"])
        == 0
    )
    out = capsys.readouterr().out
    first = "bf16" if native else "fp32"
    assert out.strip().splitlines()[-1].startswith(f"fits in 1.00 GiB: {first} with no checkpointing")
    assert ("bf16 is not native on cpu" in out) is not native


def test_speed_order_and_slow_precisions() -> None:
    entries = [EstimateEntry(p, "none", 1) for p in ("bf16", "fp32")]
    assert [e.precision for e in speed_order(entries, _facts(False))] == ["fp32", "bf16"]
    assert [e.precision for e in speed_order(entries, _facts(True))] == ["bf16", "fp32"]
    assert [e.precision for e in speed_order(entries, None)] == ["bf16", "fp32"]
    assert slow_precisions(_facts(True)) == []
    assert "use bf16" not in recommendation_line(_facts(False))
    assert "not native" in recommendation_line(_facts(False))
    assert recommendation_line(_facts(True)) == "use bf16 autocast"


def test_levers_left_out_for_want_of_torchao_name_the_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from memfit.applying import registry

    monkeypatch.setattr(registry, "torchao_available", lambda: False)
    hint = registry.missing_torchao_hint("all")
    assert hint is not None and "`pip install 'memfit[levers]'` adds it" in hint
    assert hint.startswith("state_bf16, state_8bit, state_4bit and weights_bf16 were left out")
    assert registry.missing_torchao_hint("fused_step") is None

    def infeasible(*_a: object, **_k: object) -> Plan:
        raise InfeasibleBudget("no plan fits the budget of 1 B even with the levers fused_step.", 10, 1)

    # memfit.plan adds the hint to what its planner refuses: the planner itself is stubbed
    monkeypatch.setattr("memfit.planning.planner._plan_batch", infeasible)
    assert (
        main(["plan", *TINY, "--budget", "1B", "--levers", "all", "--out", str(tmp_path / "plan.json")]) == 2
    )
    err = capsys.readouterr().err
    assert "even with the levers fused_step; state_bf16" in err and "memfit[levers]" in err


def test_demo_words() -> None:
    from memfit.cli.demo import _describe, _losses

    report = PlanReport(budget_bytes=60, baseline_peak_bytes=100)
    plan = Plan(blocks={"b0": "full", "b1": "none"}, report=report)
    assert "planned under 60 B (60% of the fp32 peak)" in _describe(plan)
    assert _losses(3, 0.0) == "over the first 3 steps the losses are identical"
    assert _losses(3, 0.25) == "over the first 3 steps the losses differ by at most 0.25"
    assert zero_grads_note([{"grads": 4}]) is None
    assert "freed" in (zero_grads_note([{"grads": 4}, {"grads": 0}]) or "")
