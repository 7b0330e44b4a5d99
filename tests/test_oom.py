"""Out of memory in a training step: the step is put back, re-planned and run again.

No step is lost and none is done twice: the run that ran out of memory at step 3 ends with
exactly the weights of a run that was never interrupted and used the new plan from step 3
on. The failure is injected by an emulated memory limit (``oom_faults.KeptBytesLimit``);
``test_oom_rlimit.py`` does the same with a real allocation failure under ``RLIMIT_AS``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_gpt
from oom_faults import KeptBytesLimit

from memfit.app.data import BatchSampler, ByteCorpus
from memfit.applying import apply
from memfit.checkpointing import checkpointed_blocks
from memfit.cli.main import main
from memfit.errors import OutOfMemory
from memfit.measuring.profile import profile
from memfit.models.gpt import gpt_loss
from memfit.planning.choose import plan_from_profiles
from memfit.records import Plan, Profile, StepMetrics
from memfit.trainer.callbacks import Callback, read_metrics
from memfit.trainer.oom import OomConfig
from memfit.trainer.trainer import Trainer

EXACT = {"rtol": 0.0, "atol": 0.0}
STEPS, FAIL_AT = 5, 3


def _sampler() -> BatchSampler:
    corpus = ByteCorpus.from_bytes(bytes(range(256)) * 64)
    return BatchSampler(corpus.train, batch_size=8, seq_len=16, seed=0)


class _Arm(Callback):
    """Arms the emulated limit after step ``after``: the device 'shrinks' mid-run."""

    def __init__(self, limit: KeptBytesLimit, after: int) -> None:
        self.limit, self.after = limit, after

    def on_step_end(self, trainer: Trainer, metrics: StepMetrics) -> None:
        if metrics.step == self.after:
            self.limit.armed = True


@pytest.fixture(scope="module")
def planned() -> tuple[Plan, dict[str, Profile], float]:
    """The first plan (no checkpointing), its profiles, and a limit just under what it keeps."""
    model = tiny_gpt(dropout=0.1, n_layer=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _sampler().batch_at(0)
    profiles = {"fp32": profile(model, batch, gpt_loss, opt, "fp32")}
    first = plan_from_profiles(profiles, 2**40)  # everything fits: the fastest plan keeps all
    assert set(first.blocks.values()) == {"none"} and first.micro_batches == 1
    kept = KeptBytesLimit(gpt_loss).kept_bytes(model, batch)
    return first, profiles, kept - 1


def _trainer(first: Plan, loss_fn: object, **kwargs: object) -> Trainer:
    model = tiny_gpt(dropout=0.1, n_layer=4)
    apply(model, first)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Trainer(model, opt, loss_fn, plan=first, progress=False, **kwargs)  # type: ignore[arg-type]


def test_out_of_memory_step_is_replanned_and_equals_the_new_plan_from_that_step(planned) -> None:  # type: ignore[no-untyped-def]
    first, profiles, kept = planned
    limit = KeptBytesLimit(gpt_loss, kept)
    a = _trainer(first, limit, callbacks=[_Arm(limit, FAIL_AT - 1)], oom=OomConfig(profiles=dict(profiles)))
    torch.manual_seed(123)
    history = a.fit(_sampler(), steps=STEPS)

    assert limit.failures == 1, "exactly one attempt ran out of memory"
    assert [m.step for m in history] == list(range(1, STEPS + 1)), "no step lost, none done twice"
    (event,) = a.replans
    second = event.plan
    assert event.step == FAIL_AT and event.budget_bytes < event.failed_peak_bytes
    assert event.failed_peak_bytes == history[FAIL_AT - 2].peak_bytes  # the tracked peak of plan 1
    assert any(m != "none" for m in second.blocks.values()) or second.micro_batches > 1
    assert a.plan is second and a.micro_batches == second.micro_batches
    assert checkpointed_blocks(a.model) == {n: m for n, m in second.blocks.items() if m != "none"}

    # the uninterrupted run: plan 1 for the steps before, plan 2 from the failed step on
    b = _trainer(first, gpt_loss)
    torch.manual_seed(123)
    sampler = _sampler()
    reference = b.fit(sampler, steps=FAIL_AT - 1)
    b.use_plan(second)
    reference += b.fit(sampler, steps=STEPS - FAIL_AT + 1)
    assert [m.loss for m in history] == [m.loss for m in reference]  # bit for bit, dropout included
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, **EXACT, msg=name)
    for x, y in zip(a.optimizer.state.values(), b.optimizer.state.values(), strict=True):
        torch.testing.assert_close(x["exp_avg_sq"], y["exp_avg_sq"], **EXACT)


def test_out_of_memory_in_the_optimizer_step_is_not_retried(planned) -> None:  # type: ignore[no-untyped-def]
    first, profiles, _ = planned
    trainer = _trainer(first, gpt_loss, oom=OomConfig(profiles=dict(profiles)))
    step = trainer.optimizer.step
    first_param = next(trainer.model.parameters())

    def half_a_step(*args: object, **kwargs: object) -> object:
        if trainer.step_count == 1:
            with torch.no_grad():
                first_param.add_(1.0)  # part of the update happened
            raise torch.OutOfMemoryError("emulated: out of memory in the optimizer step")
        return step(*args, **kwargs)

    trainer.optimizer.step = half_a_step  # type: ignore[method-assign]
    with pytest.raises(OutOfMemory) as info:
        trainer.fit(_sampler(), steps=3)
    assert isinstance(info.value, torch.OutOfMemoryError)
    message = str(info.value)
    assert "step 2 ran out of memory" in message and "optimizer step" in message and "\n" not in message
    assert "weights were partly updated" in message and trainer.step_count == 1 and not trainer.replans


def test_when_no_plan_fits_the_state_before_the_step_is_saved(planned, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    first, profiles, _ = planned
    limit = KeptBytesLimit(gpt_loss, 0)  # nothing fits: every forward pass runs out
    trainer = _trainer(
        first, limit, callbacks=[_Arm(limit, 1)], oom=OomConfig(profiles=dict(profiles)),
        last_good_path=tmp_path / "last-good.pt",
    )  # fmt: skip
    sampler = _sampler()
    torch.manual_seed(0)
    trainer.fit(sampler, steps=1)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(OutOfMemory) as info:
        trainer.fit(sampler, steps=2)
    err = info.value
    assert "step 2 ran out of memory" in str(err) and str(tmp_path / "last-good.pt") in str(err)
    assert err.state_path == tmp_path / "last-good.pt" and trainer.step_count == 1
    assert 1 <= len(trainer.replans) <= OomConfig().max_replans
    fresh = _trainer(first, gpt_loss)
    fresh.load(err.state_path)
    assert fresh.step_count == 1
    for key, value in fresh.model.state_dict().items():
        torch.testing.assert_close(value, before[key], **EXACT, msg=key)


def test_without_cached_profiles_replanning_profiles_first(planned, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """With no profiles to re-plan from, the Trainer profiles the model (here the emulated
    limit also stops profiling, which says so instead of pretending)."""
    first, _, kept = planned
    limit = KeptBytesLimit(gpt_loss, kept)
    trainer = _trainer(first, limit, callbacks=[_Arm(limit, 1)], last_good_path=tmp_path / "lg.pt")
    with pytest.raises(OutOfMemory, match="profiling it for a new plan ran out of memory too"):
        trainer.fit(_sampler(), steps=3)
    assert (tmp_path / "lg.pt").exists()


def test_replan_off_raises_at_once(planned, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    first, profiles, kept = planned
    limit = KeptBytesLimit(gpt_loss, kept)
    trainer = _trainer(
        first, limit, callbacks=[_Arm(limit, 1)], oom=OomConfig(replan=False, profiles=dict(profiles)),
        last_good_path=tmp_path / "lg.pt",
    )  # fmt: skip
    with pytest.raises(OutOfMemory, match="re-planning is off"):
        trainer.fit(_sampler(), steps=3)
    assert limit.failures == 1 and (tmp_path / "lg.pt").exists()


def test_memfit_train_replans_and_writes_it_to_the_report(
    planned, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    """``memfit train`` with ``checkpointing = "auto"``: the device 'shrinks' after step 1."""
    import memfit.app.run as run_mod

    build = run_mod.build_run
    limits: list[KeptBytesLimit] = []

    def build_then_shrink(*args: object, **kwargs: object) -> object:
        built = build(*args, **kwargs)  # type: ignore[arg-type]
        trainer = built.trainer
        limit = KeptBytesLimit(trainer.loss_fn)
        limit.limit = limit.kept_bytes(trainer.model, built.sampler.batch_at(0)) - 1
        trainer.loss_fn = limit
        trainer.callbacks.append(_Arm(limit, 1))
        limits.append(limit)
        return built

    monkeypatch.setattr(run_mod, "build_run", build_then_shrink)
    out = tmp_path / "run"
    argv = [
        "train", "--quiet", "--set", "model.n_layer=4", "--set", "model.n_embd=32", "--set", "model.n_head=2",
        "--set", "model.block_size=16", "--set", "train.batch_size=8", "--set", "train.steps=4",
        "--set", "data.max_bytes=40000", "--set", "memory.checkpointing='auto'",
        "--set", "memory.budget='100%'", "--set", f"train.out='{out}'",
    ]  # fmt: skip
    assert main(argv) == 0
    assert limits[0].failures >= 1
    assert [m.step for m in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    report = (out / "report.md").read_text()
    assert "out of memory: step 2 ran out of memory (emulated" in report and "re-planned under" in report
    assert "the step was run again" in report


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_real_allocation_failure_under_rlimit_as_is_replanned() -> None:
    """A real CPU allocation failure (``RLIMIT_AS`` in a subprocess), not an emulated one."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "MALLOC_ARENA_MAX": "1",
    }
    worker = Path(__file__).parent / "oom_rlimit_worker.py"
    done = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["steps"] == [1, 2, 3, 4, 5], "no step lost, none done twice"
    assert result["replans"], "the limit must have made a step run out of memory"
    assert all(step == 3 for step, _, _ in result["replans"])
    assert "can't allocate memory" in result["replans"][0][1]  # the CPU allocator's own error
    assert result["second"] != result["first"]
    assert result["losses"] == result["reference_losses"] and result["same_weights"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_out_of_memory_is_replanned_and_matches_the_new_plan() -> None:
    """A real ``torch.OutOfMemoryError``: the caching allocator is capped below the first plan's
    peak after two steps (``benchmarks/gpu_check.sh`` runs this)."""
    from memfit.models.gpt import GPT, GPTConfig

    dev = torch.device("cuda", torch.cuda.current_device())  # set_per_process_memory_fraction wants an index
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (16, 257), generator=g)
    batch = (x[:, :-1].contiguous().to(dev), x[:, 1:].contiguous().to(dev))

    def fresh(first: Plan | None, profiles: dict[str, Profile] | None = None) -> Trainer:
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=8, n_embd=512, n_head=8, block_size=256, dropout=0.1)).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if first is None:
            return Trainer(model, opt, gpt_loss, "fp32", progress=False)
        apply(model, first)
        return Trainer(
            model, opt, gpt_loss, plan=first, progress=False, oom=OomConfig(profiles=profiles or {})
        )

    probe = fresh(None)
    profiles = {"fp32": profile(probe.model, batch, gpt_loss, probe.optimizer, "fp32")}
    first = plan_from_profiles(profiles, 2**50)  # everything fits: no checkpointing
    del probe
    torch.cuda.empty_cache()

    a = fresh(first, profiles)
    torch.manual_seed(7)
    history = a.fit([batch] * 2, steps=2)
    assert a.memory is not None
    kept = a.memory.breakdown["params"] + a.memory.breakdown["optimizer"]
    cap = kept + 0.6 * (a.memory.peak_bytes - kept)
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total, dev)
    try:
        history += a.fit([batch] * 3, steps=3)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
    assert [m.step for m in history] == [1, 2, 3, 4, 5]
    assert a.replans and all(e.step == 3 for e in a.replans)
    assert "out of memory" in a.replans[0].error.lower()
    second = a.replans[-1].plan
    print(f"CUDA OOM re-plan: {a.replans[-1].message}")

    b = fresh(first)
    torch.manual_seed(7)
    reference = b.fit([batch] * 2, steps=2)
    b.use_plan(second)
    reference += b.fit([batch] * 3, steps=3)
    tol = {"rtol": 1e-5, "atol": 1e-6}  # GPU kernels may reduce in another order between runs
    torch.testing.assert_close(
        torch.tensor([m.loss for m in history]), torch.tensor([m.loss for m in reference]), **tol
    )
    # an embedding's backward adds rows with atomics on CUDA, in no fixed order: after five
    # AdamW steps one weight of 131,072 differed by 1.45e-6 between two runs on an H200
    weights = {"rtol": 1e-5, "atol": 1e-5}
    for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, **weights)
