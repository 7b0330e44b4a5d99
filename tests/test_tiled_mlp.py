"""The tiled MLP (memfit.levers.tiled_mlp): exact against the plain MLP on memfit's LLaMA and
GPT, under fp32 and bf16 autocast, with block checkpointing (full, selective), dropout
replayed, one gradient per parameter; undoable; found, or refused in one sentence.

The Hugging Face decoders and LoRA adapters are in tests/integrations/test_tiled_mlp_hf.py.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.errors import ConfigError
from memfit.levers.tiled_mlp import (
    chunk_spans,
    find_mlps,
    install_tiled_mlp,
    remove_tiled_mlp,
    tiled_call,
    tiled_mlps,
)
from memfit.models.gpt import GPT, GPTConfig, gpt_loss
from memfit.models.llama import llama

#: fp32: each position's values go through the same ops (a matmul of a few rows may take
#: another kernel: a last-bit difference); a weight's gradient is a sum over chunks in another
#: order (a few ulps). The gradients here are 1e-3 to 1e-1.
FP32_LOSS = {"rtol": 1e-6, "atol": 0.0}
FP32_GRAD = {"rtol": 1e-5, "atol": 1e-7}
#: bf16 autocast: a bf16 matmul's result depends on how many rows it has (the kernel's
#: blocking), so a chunk's gradients may differ by a bf16 rounding here and there: each
#: gradient is compared as a whole (relative distance of the norms' scale).
BF16_LOSS = {"rtol": 1e-4, "atol": 0.0}
BF16_GRAD_DISTANCE = 1e-2

Batch = tuple[torch.Tensor, torch.Tensor]


def _llama() -> tuple[nn.Module, Batch]:
    torch.manual_seed(0)
    spec = llama(preset="tiny", block_size=48, n_embd=64, n_head=4)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (2, 48), generator=g)
    return spec.model, (x, torch.roll(x, -1, 1))


def _gpt(dropout: float = 0.0) -> tuple[nn.Module, Batch]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=40, dropout=dropout))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (3, 40), generator=g)
    return model, (x, torch.roll(x, -1, 1))


def _step(model: nn.Module, batch: Batch, bf16: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = gpt_loss(model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_same(a: tuple, b: tuple, loss_tol: dict, grad_tol: dict) -> None:
    torch.testing.assert_close(b[0], a[0], **loss_tol)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(b[1][name], a[1][name], **grad_tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("build", [_llama, _gpt], ids=["llama", "gpt"])
@pytest.mark.parametrize("mode", [None, "full", "selective"])
def test_tiled_mlp_is_exact_in_fp32(build: Callable[[], tuple[nn.Module, Batch]], mode: str | None) -> None:
    model, batch = build()
    if mode:
        memfit.checkpoint(model, mode=mode)
    plain = _step(model, batch)
    assert install_tiled_mlp(model, chunks=5) == find_mlps(model)
    tiled = _step(model, batch)
    _assert_same(plain, tiled, FP32_LOSS, FP32_GRAD)


@pytest.mark.parametrize("mode", [None, "full", "selective"])
def test_tiled_mlp_under_bf16_autocast_is_as_close_to_fp32_as_the_plain_mlp(mode: str | None) -> None:
    model, batch = _llama()
    if mode:
        memfit.checkpoint(model, mode=mode)
    reference = _step(model, batch)
    plain = _step(model, batch, bf16=True)
    install_tiled_mlp(model, chunks=4)
    tiled = _step(model, batch, bf16=True)
    torch.testing.assert_close(tiled[0], plain[0], **BF16_LOSS)
    for name, g in plain[1].items():
        assert ((tiled[1][name] - g).norm() / g.norm()).item() <= BF16_GRAD_DISTANCE, name

    def error(run: tuple) -> float:
        return max(((run[1][n] - g).norm() / g.norm()).item() for n, g in reference[1].items())

    # bf16's own error against fp32 is larger than what chunking adds
    assert error(tiled) <= 1.25 * error(plain), (error(tiled), error(plain))


def test_dropout_masks_are_replayed_in_the_backward() -> None:
    """With dropout the tiled MLP draws one mask per chunk, in chunk order; the backward's
    recompute draws the same ones, so its gradients are those of the same chunks run plainly."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 24), nn.GELU(), nn.Dropout(0.5), nn.Linear(24, 8))
    x = torch.randn(2, 10, 8, requires_grad=True)
    grad = torch.randn(2, 10, 8)
    spans = chunk_spans(10, 3)

    def run(tiled: bool) -> list[torch.Tensor]:
        torch.manual_seed(7)
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        if tiled:
            y = tiled_call(mlp, x, 3, list(mlp.parameters()))
        else:
            y = torch.cat([mlp(x.narrow(1, s, n)) for s, n in spans], dim=1)
        y.backward(grad)
        after = torch.rand(1)  # the RNG goes on as if the backward drew nothing
        return [y.detach(), x.grad.clone(), after, *(p.grad.clone() for p in mlp.parameters())]

    for a, b in zip(run(False), run(True), strict=True):
        torch.testing.assert_close(b, a, **FP32_GRAD)


def test_each_parameter_gets_one_gradient_per_backward() -> None:
    """The sum over chunks is handed to autograd once: a post-accumulate-grad hook (the fused
    optimizer step's) fires once per parameter, as with the plain MLP."""
    model, batch = _llama()
    install_tiled_mlp(model, chunks=6)
    fired: dict[str, int] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=name: fired.__setitem__(n, fired.get(n, 0) + 1))
    _step(model, batch)
    assert set(fired.values()) == {1} and len(fired) == len(list(model.parameters()))


def test_install_and_remove_restore_the_model() -> None:
    model, _ = _gpt()
    keys = list(model.state_dict())
    before = {n: type(m).forward for n, m in model.named_modules()}
    install_tiled_mlp(model, chunks=3)
    assert tiled_mlps(model) == {"blocks.0.mlp": 3, "blocks.1.mlp": 3}
    assert "forward" in model.blocks[0].mlp.__dict__ and list(model.state_dict()) == keys
    clone = copy.deepcopy(model)  # a tiled model copies and pickles
    assert tiled_mlps(clone) == tiled_mlps(model)
    pickle.loads(pickle.dumps(model))
    install_tiled_mlp(model, chunks=7)
    assert set(tiled_mlps(model).values()) == {7}
    remove_tiled_mlp(model)
    assert tiled_mlps(model) == {}
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert {n: type(m).forward for n, m in model.named_modules()} == before


def test_one_chunk_or_one_position_runs_the_module_as_written() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 1, 4, requires_grad=True)
    assert tiled_call(lin, x, 8, list(lin.parameters())).grad_fn.name() == "ViewBackward0"
    assert chunk_spans(3, 8) == [(0, 1), (1, 1), (2, 1)] and chunk_spans(7, 1) == [(0, 7)]


def test_modules_named_by_qualified_name_or_class() -> None:
    model, _ = _llama()
    assert find_mlps(model, ["blocks.1.mlp"]) == ["blocks.1.mlp"]
    assert find_mlps(model, ["SwiGLU"]) == ["blocks.0.mlp", "blocks.1.mlp"]
    with pytest.raises(ConfigError, match=r"has no module or module class named 'blocks\.9\.mlp'"):
        find_mlps(model, ["blocks.9.mlp"])
    with pytest.raises(ConfigError, match="found no repeated blocks in Linear"):
        find_mlps(nn.Linear(2, 2))


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class _Outside(nn.Module):
    def __init__(self, shared: nn.Parameter) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.shared = [shared]  # not registered: a weight the module reads from outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.shared[0]


class _NoBlockMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_modules_that_cannot_be_tiled_are_refused_in_one_sentence() -> None:
    holder = nn.Module()
    holder.attn = _Attention()
    holder.outside = _Outside(nn.Parameter(torch.ones(8)))
    holder.lin = nn.Linear(8, 8)
    install_tiled_mlp(holder, 2, ["attn", "outside", "lin"])
    x = torch.randn(2, 6, 8)
    with pytest.raises(ConfigError, match=r"_Attention is not position-wise \(changing the input at one"):
        holder.attn(x)
    with pytest.raises(ConfigError, match="_Outside reads a trainable tensor of shape \\(8,\\) from outside"):
        holder.outside(x)
    with pytest.raises(ConfigError, match=r"sequence dimension .* its input has shape \(8,\)"):
        holder.lin(torch.randn(8))
    with pytest.raises(
        ConfigError, match="runs a module on one tensor, but Linear was called with 2 positional"
    ):
        holder.lin(x, x)
    with pytest.raises(ConfigError, match=r"block layers.0 \(Sequential\) has no child the tiled MLP knows"):
        find_mlps(_NoBlockMlp())
    with pytest.raises(ConfigError, match="chunk count must be a positive integer, got 0"):
        install_tiled_mlp(holder, 0, ["lin"])
