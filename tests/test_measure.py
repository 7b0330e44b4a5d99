"""measure(): exact peak bytes from PyTorch's tracking, and it changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch

import memfit
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.records import BREAKDOWN_KEYS, MemoryReport


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=64))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4, 65), generator=g)
    return x[:, :-1], x[:, 1:]


@pytest.fixture(scope="module")
def reports() -> dict[str, MemoryReport]:
    out = {}
    for name, mode, precision in [
        ("none", "none", "fp32"),
        ("full", "full", "fp32"),
        ("selective", "selective", "fp32"),
        ("bf16", "none", "bf16"),
    ]:
        model = _gpt()
        if mode != "none":
            memfit.checkpoint(model, mode=mode)
        opt = torch.optim.AdamW(model.parameters())
        out[name] = memfit.measure(model, _batch(), gpt_loss, opt, precision=precision, steps=1)
    return out


def test_full_keeps_less_than_half_the_activations(reports: dict[str, MemoryReport]) -> None:
    assert reports["full"].activation_bytes < reports["none"].activation_bytes / 2


def test_selective_lies_between_full_and_none(reports: dict[str, MemoryReport]) -> None:
    assert (
        reports["full"].activation_bytes
        < reports["selective"].activation_bytes
        < reports["none"].activation_bytes
    )


def test_bf16_keeps_fewer_activation_bytes(reports: dict[str, MemoryReport]) -> None:
    assert reports["bf16"].activation_bytes < reports["none"].activation_bytes


def test_breakdown_adds_up_and_counts_fixed_memory_exactly(reports: dict[str, MemoryReport]) -> None:
    params = sum(p.numel() * 4 for p in _gpt().parameters())
    for report in reports.values():
        assert set(report.breakdown) == set(BREAKDOWN_KEYS)
        assert sum(report.breakdown.values()) == report.peak_bytes
        assert report.breakdown["params"] == params
        # AdamW keeps exp_avg and exp_avg_sq (2 x params) and one 4-byte step per tensor.
        n_tensors = len(list(_gpt().parameters()))
        assert report.breakdown["optimizer"] in (0, 2 * params + 4 * n_tensors)
    assert reports["full"].peak_bytes < reports["none"].peak_bytes


def test_measure_is_repeatable() -> None:
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters())
    a = memfit.measure(model, _batch(), gpt_loss, opt, steps=1)
    b = memfit.measure(model, _batch(), gpt_loss, opt, steps=1)
    assert a.peak_bytes == b.peak_bytes
    assert a.breakdown == b.breakdown


def test_measure_leaves_model_and_optimizer_as_found() -> None:
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # One real step first, so there is optimizer state to preserve.
    gpt_loss(model, _batch()).backward()
    opt.step()
    weights = copy.deepcopy(model.state_dict())
    opt_state = copy.deepcopy(opt.state_dict())
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    memfit.measure(model, _batch(), gpt_loss, opt, steps=2)
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for pid, state in opt.state_dict()["state"].items():
        for k, v in state.items():
            assert torch.equal(v, opt_state["state"][pid][k]), (pid, k)
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)
    assert torch.equal(torch.get_rng_state(), rng)


def test_fresh_optimizer_stays_without_state() -> None:
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters())
    memfit.measure(model, _batch(), gpt_loss, opt, steps=1)
    assert opt.state_dict()["state"] == {}
    assert all(p.grad is None for p in model.parameters())


def test_fp16_scaler_state_is_restored() -> None:
    model = _gpt()
    p = memfit.Precision("fp16", device="cpu")
    before = p.scaler.get_scale()
    memfit.measure(model, _batch(), gpt_loss, torch.optim.AdamW(model.parameters()), precision=p, steps=1)
    assert p.scaler.get_scale() == before


def test_report_json_round_trip(reports: dict[str, MemoryReport]) -> None:
    r = reports["full"]
    assert MemoryReport.from_json(r.to_json()) == r
