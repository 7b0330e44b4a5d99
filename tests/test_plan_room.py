"""Planning a step that does not fit: memory from a fake-tensor twin, times from steps that fit.

The subprocess tests lower ``RLIMIT_AS`` (``plan_rlimit_worker.py``) so the plain step cannot
run, plan, and train the plan there; the plan is then measured here, unconstrained.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_gpt, token_batch
from models_for_room import build
from room_helpers import (
    assert_planned_under_the_limit,
    linux_only,
    measured_unconstrained,
    plain_peak,
    run_worker,
    worker_env,
)

import memfit
from memfit.cli.main import main
from memfit.devices import Room, room
from memfit.errors import ConfigError
from memfit.measuring.fake_profile import memory_profile
from memfit.measuring.preserve import create_optimizer_state, preserved
from memfit.measuring.profile import Profiler, profile
from memfit.models.gpt import gpt_loss
from memfit.precision import Precision
from memfit.records import Plan
from memfit.stepmodel import simulate


@pytest.mark.slow
@linux_only
def test_a_step_that_does_not_fit_is_planned_and_trained_under_the_limit() -> None:
    """The limit leaves room for 60% of the plain step; the plan is for 45% of it."""
    peak = plain_peak("gpt-4x128")
    result = run_worker("--model", "gpt-4x128", "--peak", str(peak), "--try-plain")
    assert_planned_under_the_limit("gpt-4x128", result)


@pytest.mark.slow
@linux_only
def test_a_step_only_the_chunked_head_lets_run_is_planned_and_trained_under_the_limit() -> None:
    """A 32k vocabulary at 2,048 tokens: the loss head's logits are most of the step, so under a
    limit with room for 60% of it not even a fully checkpointed step without levers runs; whole
    steps are timed with the head in chunks (Note [timing with a lever] in
    memfit/measuring/profile.py) and the plan, for 20%, trains under the limit."""
    peak = plain_peak("gpt-wide-head")
    args = ["--model", "gpt-wide-head", "--peak", str(peak), "--try-plain", "--room", "0.6"]
    result = run_worker(*args, "--budget", "0.2", "--levers", "chunked_loss")
    assert_planned_under_the_limit("gpt-wide-head", result)
    p = Plan.from_dict(result["plan"])
    assert "chunked_loss" in p.levers
    assert any("the loss head in chunks of" in m for m in p.report.measured), p.report.measured


@pytest.mark.slow
@linux_only
def test_the_largest_batch_is_searched_without_allocating_it() -> None:
    """Probes run under fake tensors; the answer is planned and trained under the limit."""
    peak = plain_peak("gpt-4x128")
    result = run_worker("--model", "gpt-4x128", "--peak", str(peak), "--maximize", "--budget", "0.45")
    p = Plan.from_dict(result["plan"])
    assert p.micro_batches == 1 and p.batch_size > 0
    assert p.predicted_peak_bytes <= p.budget_bytes
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    measured = measured_unconstrained("gpt-4x128", p, batch_rows=p.batch_size)
    assert measured <= p.budget_bytes


@pytest.mark.slow
@linux_only
def test_bench_reports_a_strategy_that_does_not_fit_without_running_it() -> None:
    peak = plain_peak("gpt-4x128")
    # room for 80% of the plain step: not for it, but for the fully checkpointed one and the
    # copies bench makes of the model and its optimizer
    result = run_worker("--model", "gpt-4x128", "--peak", str(peak), "--bench", "--room", "0.8")
    points = {p["strategy"]: p for p in result["points"]}
    plain, full = points["fp32/none"], points["fp32/full"]
    assert plain["error"].startswith("does not fit: estimated under fake tensors at")
    assert plain["peak_bytes"] == peak and not plain["step_times"]
    assert not full["error"] and full["peak_bytes"] < 0.6 * peak and full["step_times"]


def test_a_model_fake_tensors_cannot_run_is_measured_for_real() -> None:
    model, batch, loss_fn = build("reads-values-small")
    p = memfit.plan(model, batch, loss_fn, "60%", precision="fp32")
    measured = p.report.measured
    assert any(m.startswith("fake tensors cannot run ReadsValues") for m in measured), measured
    assert p.measured_peak_bytes <= p.budget_bytes
    assert "full" in p.blocks.values() or p.micro_batches > 1


@pytest.mark.slow
@linux_only
def test_a_model_fake_tensors_cannot_run_and_that_does_not_fit_is_refused_in_one_sentence() -> None:
    peak = plain_peak("reads-values")
    result = run_worker("--model", "reads-values", "--peak", str(peak), "--expect-error")
    assert result["kind"] == "OutOfMemory", result
    message = result["error"]
    assert message.startswith("the step without checkpointing ran out of memory on cpu (room ")
    assert "fake tensors could not run it" in message and "smaller batch" in message
    assert "\n" not in message


def test_a_profile_whose_plain_step_does_not_fit_has_the_real_profiles_bytes() -> None:
    """With the room made small, every mode's memory comes from the fake twin, byte for byte."""
    model, batch = tiny_gpt(n_layer=4), token_batch(8, 16)
    opt = torch.optim.AdamW(model.parameters())
    real = profile(model, batch, gpt_loss, opt, repeats=1)
    with preserved(model, opt):
        prof = Profiler(model, batch, gpt_loss, opt, Precision("fp32"))
        create_optimizer_state(model, opt)
        estimate = prof.estimated_peak()
        assert estimate == real.measured_peak_bytes
        start = prof.estimate.start if prof.estimate else 0
        # room for 55% of the plain step's extra bytes
        prof.room = Room(free=int((estimate - start) * 0.55 * 1.1) + 16 * 2**20, source="a test")
        prof.none()
        assert prof.fake
        prof.modes(["selective", "full"])
        prof.time(1)
        prof.time_checkpointed(1, rounds=2)
        fake = prof.result()
    assert fake.memory_from == "fake tensors" and real.memory_from == "tracked"
    for a, b in zip(fake.blocks, real.blocks, strict=True):
        assert a.saved_bytes == b.saved_bytes and a.backward_peak_bytes == b.backward_peak_bytes
    assert simulate(fake, "full").peak_bytes == simulate(real, "full").peak_bytes
    assert fake.speed is not None and fake.speed.timed_as.startswith("with")
    assert fake.step_seconds > 0 and all(b.forward_seconds > 0 for b in fake.blocks)


def test_a_step_whose_smallest_plan_does_not_fit_the_room_is_refused_before_it_runs() -> None:
    model, batch = tiny_gpt(n_layer=4), token_batch(8, 16)
    opt = torch.optim.AdamW(model.parameters())
    with preserved(model, opt):
        prof = Profiler(model, batch, gpt_loss, opt, Precision("fp32"))
        prof.room = Room(free=1024, source="a test")
        prof.none()
        assert prof.fake
        with pytest.raises(
            memfit.InfeasibleBudget, match=r"room of 1.00 KiB \(a test\): its smallest"
        ) as info:
            prof.time(1)
    assert not prof.times, "no step ran"
    assert info.value.minimum_bytes > info.value.budget_bytes


def test_memory_profile_allocates_no_step() -> None:
    model, batch = tiny_gpt(n_layer=3), token_batch(4, 16)
    opt = torch.optim.AdamW(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prof = memory_profile(model, batch, gpt_loss, opt)
    assert prof.memory_from == "fake tensors" and prof.speed is None
    assert set(prof.blocks[0].saved_bytes) == {"none", "selective", "full"}
    assert prof.measured_peak_bytes == memfit.measure(model, batch, gpt_loss, opt).peak_bytes
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not opt.state, "the optimizer is left as it was given"


def test_a_budget_over_the_device_is_refused_in_one_sentence() -> None:
    model = tiny_gpt()
    free = room("cpu")
    assert free is not None
    too_much = free.free + 2**40
    for maximize in (None, "batch_size"):
        with pytest.raises(ConfigError, match=r"is more than cpu has room for: .* free by ") as info:
            memfit.plan(model, token_batch(), gpt_loss, too_much, maximize=maximize)
        assert str(info.value).count(". ") == 0 and "\n" not in str(info.value)


def test_a_budget_over_the_device_is_exit_2_at_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2"]
    assert main(["plan", *tiny, "--budget", "900TiB", "--maximize", "batch_size"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is more than cpu has room for" in err and len(err.splitlines()) == 1


def test_the_device_budget_is_the_room_less_its_margin() -> None:
    model = tiny_gpt()
    free = room("cpu")
    assert free is not None
    p = memfit.plan(model, token_batch(), gpt_loss, "device", precision="fp32")
    params = sum(t.numel() * t.element_size() for t in model.parameters())
    # the room is read at planning time: within a few MiB of the one read here
    assert abs(p.budget_bytes - free.usable) <= 2 * params + 256 * 2**20
    assert p.predicted_peak_bytes <= p.budget_bytes and set(p.blocks.values()) == {"none"}


TRAIN_SETS = {
    "model.n_layer": "4",
    "model.n_embd": "128",
    "model.n_head": "2",
    "model.block_size": "256",
    "train.batch_size": "16",
    "train.steps": "3",
    "train.eval_every": "3",
    "train.eval_batches": "1",
    "data.max_bytes": "200000",
    "memory.checkpointing": "auto",
    "memory.precision": "fp32",
}


@pytest.mark.slow
@linux_only
def test_memfit_train_with_a_budget_trains_a_step_that_does_not_fit(tmp_path: Path) -> None:
    """The plain step needs more than the process may allocate; ``memfit train`` plans and trains."""
    from memfit.app.config import load_config
    from memfit.cli.model_args import batch_for, optimizer_fn, spec_for
    from memfit.trainer.callbacks import read_metrics

    sets = [f"{k}={v}" for k, v in TRAIN_SETS.items()]
    cfg = load_config(None, [s for s in sets if not s.startswith("memory.")])
    spec = spec_for(cfg)
    opt = optimizer_fn(cfg)(spec.model.parameters())
    plain = memfit.measure(spec.model, batch_for(spec, cfg), spec.loss_fn, opt, steps=1)
    held = plain.breakdown["params"] + plain.breakdown["optimizer"]
    out = tmp_path / "run"
    argv = [a for s in sets for a in ("--set", s)]
    argv += ["--set", f"memory.budget={int(0.45 * plain.peak_bytes)}", "--set", f"train.out={out}"]
    here, env = Path(__file__).parent, worker_env()
    # room for the model, its optimizer state, the data, and 60% of the plain step
    allowance = 2 * held + int(0.60 * plain.peak_bytes) + 16 * 2**20
    done = subprocess.run(
        [sys.executable, str(here / "train_rlimit_worker.py"), str(allowance), "train", *argv],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m.step for m in metrics] == [1, 2, 3]
    tracked = [m.peak_bytes for m in metrics if m.peak_bytes is not None]
    assert tracked and all(p <= 0.45 * plain.peak_bytes for p in tracked), tracked
    assert all(torch.isfinite(torch.tensor([m.loss for m in metrics])))
    report = (out / "report.md").read_text()
    assert "planning: the step without checkpointing" in report and "does not fit the room" in report


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_step_that_does_not_fit_is_planned_and_trained() -> None:
    """The caching allocator is capped (``set_per_process_memory_fraction``) to what is held
    plus half of the plain step's extra bytes; ``benchmarks/gpu_check.sh`` runs this."""
    import math

    from memfit.models.gpt import GPT, GPTConfig
    from memfit.step import training_step

    dev = torch.device("cuda", torch.cuda.current_device())  # set_per_process_memory_fraction wants an index
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_embd=512, n_head=8, block_size=512)).to(dev)
    x = torch.randint(0, 256, (16, 513), generator=torch.Generator().manual_seed(1)).to(dev)
    batch = (x[:, :-1].contiguous(), x[:, 1:].contiguous())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plain = memfit.measure(model, batch, gpt_loss, opt, steps=1).peak_bytes
    create_optimizer_state(model, opt)
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated(dev)
    allowed = held + (plain - held) // 2
    torch.cuda.set_per_process_memory_fraction(
        allowed / torch.cuda.get_device_properties(dev).total_memory, dev
    )
    try:
        with pytest.raises(torch.OutOfMemoryError):
            training_step(model, batch, gpt_loss, opt, Precision("fp32"))
        opt.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        p = memfit.plan(model, batch, gpt_loss, "device", opt, precision="fp32")
        planned, planned_opt = memfit.prepare(model, opt, p)
        torch.cuda.reset_peak_memory_stats(dev)
        losses = [float(memfit.train_step(planned, batch, gpt_loss, planned_opt, p)) for _ in range(3)]
        peak = torch.cuda.max_memory_allocated(dev)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
    print(
        f"RESULT cuda: plain {plain:,} B, allowed {allowed:,} B, budget {p.budget_bytes:,} B, predicted "
        f"{p.predicted_peak_bytes:,} B, measured {peak:,} B, planning {p.report.planning_seconds:.1f} s, "
        f"losses {losses}, plan {sorted(set(p.blocks.values()))} x{p.micro_batches}"
    )
    assert all(math.isfinite(v) for v in losses)
    assert peak <= allowed and p.predicted_peak_bytes <= p.budget_bytes <= allowed
    assert any("fake-tensor twin" in n for n in p.notes), p.notes


@linux_only
def test_the_readme_largest_batch_command_answers_or_refuses_within_the_room() -> None:
    """``memfit plan --maximize batch_size --budget 24GiB`` (issues 22 and 26): on a machine with
    less room it is one sentence and exit 2 at once; with more, probes run under fake tensors.
    Either way the process stays far below the room it read (the child's peak resident set)."""
    import resource

    free = room("cpu")
    assert free is not None
    tiny = ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "memfit.cli.main",
            "plan",
            "--maximize",
            "batch_size",
            "--budget",
            "24GiB",
            *tiny,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=worker_env(),
    )
    grown = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if free.free < 24 * 2**30:
        said = [line for line in done.stderr.splitlines() if not line.startswith("memfit: ")]  # progress
        assert done.returncode == 2 and len(said) == 1, done.stderr
        assert "is more than cpu has room for" in done.stderr
    else:
        assert done.returncode in (0, 2), done.stderr[-2000:]
    assert grown < free.free


def test_memfit_train_refuses_a_budget_over_the_device_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(["train", "--set", "memory.budget=900TiB", "--set", f"train.out={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is more than cpu has room for" in err and len(err.splitlines()) == 1
    assert not out.exists() or not any(out.iterdir())


def test_fake_steps_leave_fp16_loss_scaling_real() -> None:
    """A fake step runs without loss scaling: a scaler first used under fake tensors would keep
    a fake scale, and every real fp16 step after it would fail."""
    from torch._subclasses.fake_tensor import FakeTensor

    model, batch = tiny_gpt(n_layer=2), token_batch(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    prec = Precision("fp16")
    prof = profile(model, batch, gpt_loss, opt, prec, repeats=1)
    assert prof.measured_peak_bytes > 0
    scale = prec.scaler._scale
    assert scale is None or not isinstance(scale, FakeTensor)
    p = memfit.plan(model, batch, gpt_loss, "90%", opt, precision="fp16")
    assert p.precision == "fp16" and p.measured_peak_bytes <= p.budget_bytes
    points = memfit.bench(model, batch, gpt_loss, opt, strategies=["fp16/none", "fp16/full"], steps=1)
    errors = {q.strategy: q.error for q in points}
    assert errors["fp16/none"] == errors["fp16/full"] == "", errors
