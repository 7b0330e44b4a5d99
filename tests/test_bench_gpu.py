"""memfit.bench on a CUDA device: allocator statistics, parked copies. Skipped without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

import memfit
from memfit.models.gpt import GPT, GPTConfig, gpt_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model_and_batch() -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=256, n_head=4, block_size=256))
    # 16 rows: activations outweigh the weights and AdamW state, so checkpointing lowers the
    # peak (at 4 rows the first H200 run read bf16/full 216,340,992 B, bf16/none 214,718,976 B)
    x = torch.randint(0, 256, (16, 257))
    return model, (x[:, :-1].contiguous(), x[:, 1:].contiguous())


def test_bench_on_cuda_uses_allocator_statistics_and_frees_its_copies() -> None:
    model, batch = _model_and_batch()  # stays on the CPU; copies run on the GPU
    before = torch.cuda.memory_allocated()
    points = memfit.bench(
        model, batch, gpt_loss, lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        strategies=["fp32/none", "fp32/full", "bf16/none", "bf16/full", "fp16/selective"], steps=2,
        device="cuda",
    )  # fmt: skip
    by = {p.strategy: p for p in points}
    assert all(p.ok for p in points), [p.error for p in points]
    assert all(p.tracker == "cuda-allocator" and p.device.startswith("cuda") for p in points)
    assert by["fp32/full"].peak_bytes < by["fp32/none"].peak_bytes
    assert by["bf16/full"].peak_bytes < by["bf16/none"].peak_bytes < by["fp32/none"].peak_bytes
    assert all(sum(p.breakdown.values()) == p.peak_bytes for p in points)
    # every copy was parked on the CPU or dropped: the GPU holds only the batch now
    batch_bytes = sum(t.numel() * t.element_size() for t in batch)
    assert torch.cuda.memory_allocated() - before <= batch_bytes + 2**20


def test_bench_peak_matches_measure_on_cuda() -> None:
    model, batch = _model_and_batch()
    (point,) = memfit.bench(model, batch, gpt_loss, None, strategies=["fp32/none"], steps=1, device="cuda")
    ref = copy.deepcopy(model).cuda()
    cuda_batch = tuple(t.cuda() for t in batch)
    report = memfit.measure(ref, cuda_batch, gpt_loss, None, steps=1)
    # both read torch.cuda.max_memory_allocated over one step with the same tensors resident
    assert abs(point.peak_bytes - report.peak_bytes) <= 0.02 * report.peak_bytes
