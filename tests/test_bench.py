"""memfit.bench: peaks from PyTorch's tracking, FLOP ratios, failures reported, model untouched."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from conftest import (
    DropoutMLP,
    SmallCNN,
    cnn_loss,
    image_batch,
    mse_loss,
    tiny_gpt,
    token_batch,
    vector_batch,
)
from torch import nn

import memfit
from memfit.benchmarking.pareto import pareto_front
from memfit.benchmarking.sequential import NotSequential, install_sequential
from memfit.benchmarking.strategies import Strategy, builtin_strategy, resolve_strategies
from memfit.checkpointing import checkpoint, checkpointed_blocks
from memfit.devices import device_facts
from memfit.errors import ConfigError
from memfit.models.gpt import gpt_loss
from memfit.records import BenchPoint

RTOL, ATOL = 1e-5, 1e-6  # fp32 recompute runs the same kernels: only summation order may differ
FP32 = ["fp32/none", "fp32/full", "fp32/every2", "fp32/sequential", "fp32/selective"]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # NOTE: the test machine is shared; one thread keeps tiny steps from stalling on OpenMP.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class SkipNet(nn.Module):
    """Blocks called in a chain, but the first block's output (inside checkpoint_sequential's
    first segment of two blocks) is used again after the last."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = h = self.blocks[0](x)
        for block in self.blocks[1:]:
            h = block(h)
        return self.out(h + h1)


class NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _by_name(points: list[BenchPoint]) -> dict[str, BenchPoint]:
    return {p.strategy: p for p in points}


def test_peaks_equal_measure_on_the_same_config() -> None:
    model = tiny_gpt(n_layer=4)
    batch = token_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    points = _by_name(memfit.bench(model, batch, gpt_loss, opt, strategies=FP32, steps=1))
    assert all(p.ok for p in points.values()), [p.error for p in points.values()]
    for name, mode, every in (
        ("fp32/none", "none", 1),
        ("fp32/full", "full", 1),
        ("fp32/every2", "full", 2),
        ("fp32/selective", "selective", 1),
    ):
        ref = copy.deepcopy(model)
        if mode != "none":
            checkpoint(ref, mode=mode, every=every)
        report = memfit.measure(ref, batch, gpt_loss, torch.optim.AdamW(ref.parameters(), lr=1e-3), steps=1)
        assert points[name].peak_bytes == report.peak_bytes, name
        assert points[name].breakdown == report.breakdown, name
        assert sum(points[name].breakdown.values()) == points[name].peak_bytes
    none, full = points["fp32/none"], points["fp32/full"]
    assert full.peak_bytes < points["fp32/every2"].peak_bytes < none.peak_bytes
    assert points["fp32/sequential"].peak_bytes < none.peak_bytes
    assert none.peak_ratio == 1.0 and none.time_ratio == 1.0 and none.baseline == "fp32/none"
    assert full.peak_ratio == pytest.approx(full.peak_bytes / none.peak_bytes)
    assert full.time_ratio == pytest.approx(full.step_seconds / none.step_seconds)
    assert all(p.tracker == "MemTracker" and p.device == "cpu" for p in points.values())


def test_recompute_fraction_counts_flops() -> None:
    model = tiny_gpt(n_layer=4)
    points = _by_name(memfit.bench(model, token_batch(), gpt_loss, None, strategies=FP32, steps=1))
    assert points["fp32/none"].recompute_fraction == 1.0
    # selective keeps every matmul/attention output, so no counted FLOP is recomputed
    assert points["fp32/selective"].recompute_fraction == 1.0
    assert points["fp32/full"].flops > points["fp32/every2"].flops > points["fp32/none"].flops > 0
    # full recomputes every block's forward: less than one whole extra forward (embeddings, head)
    assert 1.1 < points["fp32/full"].recompute_fraction < 4 / 3
    assert 1.0 < points["fp32/sequential"].recompute_fraction < points["fp32/full"].recompute_fraction


def test_front_flags_and_step_times() -> None:
    points = memfit.bench(tiny_gpt(), token_batch(), gpt_loss, None, strategies=FP32, steps=2)
    assert [p.on_front for p in points] == pareto_front([(p.peak_bytes, p.step_seconds) for p in points])
    assert any(p.on_front for p in points)
    for p in points:
        assert len(p.step_times) == 2 and p.step_seconds > 0
        assert p.step_seconds == pytest.approx(sorted(p.step_times)[0] / 2 + sorted(p.step_times)[1] / 2)


def test_the_model_rng_and_optimizer_are_left_as_they_were() -> None:
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    memfit.bench(model, token_batch(), gpt_loss, opt, strategies=["fp32/full", "fp32/sequential"], steps=1)
    assert checkpointed_blocks(model) == {}
    assert "forward" not in model.blocks[0].__dict__
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert opt.state == {}
    assert torch.equal(torch.get_rng_state(), rng)


def test_unsupported_precision_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    no_fp16 = replace(device_facts("cpu"), fp16_runs=False, fp16_native=False)
    monkeypatch.setattr("memfit.precision.core.device_facts", lambda device=None: no_fp16)
    model = DropoutMLP(n_blocks=3)
    points = _by_name(
        memfit.bench(
            model, vector_batch(), mse_loss, None, strategies=["fp32/none", "fp16/none", "fp16/full"], steps=1
        )
    )
    assert points["fp32/none"].ok
    for name in ("fp16/none", "fp16/full"):
        assert not points[name].ok and "cannot run fp16" in points[name].error
        assert points[name].peak_bytes == 0 and not points[name].on_front


def test_sequential_on_a_non_sequential_model_is_reported_with_the_reason() -> None:
    points = _by_name(
        memfit.bench(DropoutMLP(n_blocks=3), vector_batch(), mse_loss, None, strategies=FP32, steps=1)
    )
    seq = points["fp32/sequential"]
    assert not seq.ok and "does not take block layers.0's output" in seq.error
    assert all(points[n].ok for n in FP32 if n != "fp32/sequential")


def test_sequential_refuses_a_reused_intermediate_output() -> None:
    model = SkipNet()
    with pytest.raises(NotSequential, match="changed the loss"):
        install_sequential(model, mse_loss, vector_batch(width=8))
    assert "forward" not in model.blocks[0].__dict__  # nothing left installed


@pytest.mark.parametrize("kind", ["nn.Sequential", "nn.ModuleList"])
def test_sequential_matches_plain_gradients(kind: str) -> None:
    if kind == "nn.Sequential":
        model, loss_fn, batch = SmallCNN(n_blocks=4), cnn_loss, image_batch()
    else:
        model, loss_fn, batch = tiny_gpt(n_layer=4), gpt_loss, token_batch()
    ref = copy.deepcopy(model)
    install_sequential(model, loss_fn, batch)
    torch.testing.assert_close(loss_fn(model, batch), loss_fn(ref, batch), rtol=RTOL, atol=ATOL)
    loss_fn(model, batch).backward()
    loss_fn(ref, batch).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)
    assert model.state_dict().keys() == ref.state_dict().keys()


def test_sequential_bench_on_an_nn_sequential_saves_memory() -> None:
    batch = image_batch()
    points = _by_name(
        memfit.bench(
            SmallCNN(n_blocks=4), batch, cnn_loss, None, strategies=["fp32/none", "fp32/sequential"], steps=1
        )
    )
    assert points["fp32/sequential"].ok
    assert points["fp32/sequential"].peak_bytes < points["fp32/none"].peak_bytes


def test_sequential_needs_repeated_blocks() -> None:
    one = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 1))
    with pytest.raises(NotSequential, match="no repeated blocks"):
        install_sequential(one, mse_loss, vector_batch(width=8))


def test_a_model_without_blocks_fails_checkpointing_strategies_only() -> None:
    points = _by_name(
        memfit.bench(NoBlocks(), vector_batch(width=8), mse_loss, None, strategies=FP32, steps=1)
    )
    assert points["fp32/none"].ok
    for name in ("fp32/full", "fp32/every2", "fp32/sequential", "fp32/selective"):
        assert "found no repeated blocks" in points[name].error


def test_custom_strategy_with_micro_batches() -> None:
    def first_block_only(model: nn.Module, batch: object, loss_fn: object) -> nn.Module:
        return checkpoint(model, blocks=["blocks.0"], mode="full")

    custom = Strategy(
        name="fp32/first+mb2",
        precision="fp32",
        checkpointing="custom",
        prepare=first_block_only,
        micro_batches=2,
    )
    points = _by_name(
        memfit.bench(tiny_gpt(), token_batch(batch=4), gpt_loss, None, strategies=[custom], steps=1)
    )
    assert list(points) == ["fp32/none", "fp32/first+mb2"]  # the baseline is always measured
    p = points["fp32/first+mb2"]
    assert p.ok and p.micro_batches == 2 and p.checkpointing == "custom"
    assert p.peak_bytes < points["fp32/none"].peak_bytes


def test_optimizer_template_gets_a_fresh_copy_per_strategy() -> None:
    model = tiny_gpt()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])
    points = memfit.bench(model, token_batch(), gpt_loss, opt, strategies=["fp32/none"], steps=1)
    assert points[0].ok and points[0].breakdown["optimizer"] > 0
    foreign = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="not the model's"):
        memfit.bench(model, token_batch(), gpt_loss, foreign, strategies=["fp32/none"], steps=1)
    made = memfit.bench(
        model,
        token_batch(),
        gpt_loss,
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        strategies=["fp32/none"],
        steps=1,
    )
    assert made[0].ok and made[0].breakdown["optimizer"] == 0  # plain SGD keeps no state


def test_bad_input_is_refused_with_the_fix() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown strategy 'fp32/ful' \(did you mean 'fp32/full'\?\); valid:"
    ):
        memfit.bench(tiny_gpt(), token_batch(), gpt_loss, strategies=["fp32/ful"])
    with pytest.raises(ConfigError, match="steps must be a positive integer"):
        memfit.bench(tiny_gpt(), token_batch(), gpt_loss, strategies=["fp32/none"], steps=0)
    with pytest.raises(ConfigError, match="no strategies"):
        resolve_strategies([])


def test_strategy_names_and_patterns() -> None:
    assert [s.name for s in resolve_strategies(["*/full"])] == ["fp32/full", "bf16/full", "fp16/full"]
    assert len(resolve_strategies(["all"])) == 15
    assert len(resolve_strategies(None)) == 15
    assert [s.name for s in resolve_strategies(["fp32/none", "fp32/*"])][:2] == ["fp32/none", "fp32/full"]
    assert builtin_strategy("bf16", "every2").name == "bf16/every2"


def test_bench_point_json_round_trip() -> None:
    p = BenchPoint(
        "bf16/full",
        "bf16",
        "full",
        peak_bytes=10,
        breakdown={"params": 4, "activations": 6},
        step_times=[0.1, 0.2],
        on_front=True,
        error="",
    )
    assert BenchPoint.from_json(p.to_json()) == p


def test_measure_tracks_micro_batches() -> None:
    # tracked_step (shared with measure) runs the root module once per micro-batch
    model = tiny_gpt()
    peaks = [
        memfit.measure(model, token_batch(batch=4), gpt_loss, None, steps=1, micro_batches=mb).peak_bytes
        for mb in (1, 2, 4)
    ]
    assert peaks[0] > peaks[1] > peaks[2] > 0
