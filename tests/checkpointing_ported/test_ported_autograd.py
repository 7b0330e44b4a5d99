"""PyTorch's ``test/test_autograd.py`` TestAutograd checkpoint tests, ported to ``memfit.checkpoint``.

Each test names the peer test it ports; the peer's checkpointed function is a block here,
run in full and in selective mode, and compared with the plain model exactly (outputs,
gradients, buffers, RNG stream). Cases of reentrant checkpointing, ``context_fn`` and CUDA
only are left out: memfit owns the contexts and is non-reentrant.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from ported import MODES, Counted, check, observe, twins
from torch import nn


class Holder(nn.Module):
    """A model whose one block is called as the peer calls its function."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.block(*args, **kwargs)


def _proxy() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 100), nn.ReLU(), nn.Linear(100, 10))


@pytest.mark.parametrize("mode", MODES)
def test_checkpointing(mode: str) -> None:
    """test_checkpointing: one small network checkpointed once per input, many inputs, one joint loss."""

    def case(m: nn.Module) -> Any:
        xs = [torch.rand(1, 10, requires_grad=True) for _ in range(50)]
        mean = torch.stack([m(x) for x in xs]).mean()
        mean.backward()
        return mean, [x.grad for x in xs]

    check(lambda: Holder(_proxy()), ["block"], mode, case)


class ThreeMatmuls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.y, self.z = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3, 3))
        self.dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.mm(x, self.y)  # mm runs in the autocast dtype, in the forward and in the recompute
        y = torch.mm(x, self.z)
        self.dtypes.append(y.dtype)  # before the last op: the recompute (stopping early) gets here
        return torch.mm(y, self.z)


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_non_reentrant_autocast_cpu(mode: str, enabled: bool) -> None:
    """test_checkpointing_non_reentrant_autocast_cpu: the recompute runs at the forward's autocast dtype."""

    def case(m: nn.Module) -> Any:
        x = torch.randn(3, 3, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            loss = m(x).sum()
        loss.backward()
        return loss, x.grad

    check(lambda: Holder(ThreeMatmuls()), ["block"], mode, case)
    want = torch.bfloat16 if enabled else torch.float32
    _, ckpt = twins(lambda: Holder(ThreeMatmuls()), ["block"], mode)
    observe(ckpt, case)
    assert set(ckpt.block.dtypes) == {want} and len(ckpt.block.dtypes) == 2  # forward and recompute


class Keyworded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = _proxy()

    def forward(self, data: torch.Tensor) -> torch.Tensor:
        return self.module(data)


@pytest.mark.parametrize("input_requires_grad", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_without_reentrant(mode: str, input_requires_grad: bool) -> None:
    """test_checkpointing_without_reentrant: keyword input, inputs that do or do not require grad."""

    def case(m: nn.Module) -> Any:
        outs = []
        for _ in range(20):
            data = torch.empty(1, 10).uniform_().requires_grad_(input_requires_grad)
            outs.append(m(data=data))
        torch.stack(outs).mean().backward()
        return outs

    check(lambda: Holder(Keyworded()), ["block"], mode, case)


class NoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.lin2 = nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.lin2(self.linear(x))


@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_without_reentrant_detached_tensor(mode: str) -> None:
    """test_checkpointing_without_reentrant_detached_tensor: a block whose output does not require grad."""

    def case(m: nn.Module) -> Any:
        a = torch.randn(2, 2, requires_grad=True)
        for _ in range(3):
            out = m(a)
            out += a
            out.sum().backward()
        return a.grad

    check(lambda: Holder(NoGrad()), ["block"], mode, case)


@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_without_reentrant_saved_object_identity(mode: str) -> None:
    """test_checkpointing_without_reentrant_saved_object_identity: an input a custom Function saves is
    the very object its backward gets back."""
    found: list[torch.Tensor] = []

    class Save(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(y)
            return x * 1

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> Any:
            found.append(ctx.saved_tensors[0])
            return g, None

    b = torch.tensor(1.0)
    _, ckpt = twins(lambda: Holder(Counted(Save.apply)), ["block"], mode)
    ckpt(torch.tensor(1.0, requires_grad=True), b).backward()
    assert found and found[-1] is b


@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_without_reentrant_correct_grad(mode: str) -> None:
    """test_checkpointing_without_reentrant_correct_grad: backward() and autograd.grad() agree with plain."""

    def case(m: nn.Module) -> Any:
        a = torch.randn(2, 2, requires_grad=True)
        m(a).sum().backward()
        (d,) = torch.autograd.grad(m(a).sum(), (a,))
        return a.grad, d

    check(lambda: Holder(Counted(torch.exp, 2)), ["block"], mode, case)


class SharedWeight(nn.Module):
    """The parameter ``w`` is used outside the block and inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(10, 10))
        self.block = Counted(self._inside)

    def _inside(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.w * x)


@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_without_reentrant_parameter_used_in_an_out(mode: str) -> None:
    """test_checkpointing_without_reentrant_parameter_used_in_an_out: a gradient hook runs once
    per backward."""

    def case(m: nn.Module) -> Any:
        count = [0]
        handle = m.w.register_hook(lambda g: count.__setitem__(0, count[0] + 1))
        m(torch.rand(10, 10, requires_grad=True)).sum().backward()
        handle.remove()
        return count[0]

    _, got = check(SharedWeight, ["block"], mode, case)
    assert got.values == 1


class DictBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(5, 5, bias=False)

    def forward(self, dict_input: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"result": self.layer(dict_input["tensor"])}


@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_without_reentrant_arbitrary_input_output(mode: str) -> None:
    """test_checkpointing_without_reentrant_arbitrary_input_output: a dict in, a dict out."""

    def case(m: nn.Module) -> Any:
        out = m({"tensor": torch.randn(5, 5)})["result"].sum()
        out.backward()
        return out

    check(lambda: Holder(DictBlock()), ["block"], mode, case)


class SavesFive(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        w = x * y * z
        out = w + w
        ctx.save_for_backward(x, y, z, w, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        x, y, z, w, out = ctx.saved_tensors
        return grad_out * y * z * 2, grad_out * x * z * 2, grad_out * x * y * 2 + 0 * w * out


def _foo(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    x = x * y * z
    y = y * y * z
    z = z * z
    return SavesFive.apply(x, y, z)


@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_without_reentrant_custom_function_works(mode: str) -> None:
    """test_checkpointing_without_reentrant_custom_function_works: a custom Function saving inputs and
    intermediates inside the block."""

    def case(m: nn.Module) -> Any:
        x, y, z = (torch.tensor(v, requires_grad=True) for v in (1.0, 2.0, 3.0))
        out = m(x, y, z)
        out.sum().backward()
        return out, x.grad, y.grad, z.grad

    check(lambda: Holder(Counted(_foo)), ["block"], mode, case)


def _two_stage(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x.sin().cos()
    return y, y.sin().cos()


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_graph_execution_group(mode: str) -> None:
    """test_checkpoint_graph_execution_group (without a group): two autograd.grad calls over disjoint
    parts of one checkpointed block; it recomputes once for each."""

    def case(m: nn.Module) -> Any:
        x = torch.randn(3, 3, requires_grad=True)
        y, z = m(x)
        (grad_y,) = torch.autograd.grad(z, inputs=(y,), grad_outputs=(torch.ones(3, 3),))
        (grad_x,) = torch.autograd.grad(y, inputs=(x,), grad_outputs=(grad_y,))
        return grad_y, grad_x

    check(lambda: Holder(Counted(_two_stage)), ["block"], mode, case)
    _, ckpt = twins(lambda: Holder(Counted(_two_stage)), ["block"], mode)
    observe(ckpt, case)
    assert ckpt.block.calls == 3


class ChangesCourse(nn.Module):
    """Saves three tensors in its forward and two (or others) in its recompute."""

    def __init__(self, recompute: str) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.recompute, self.calls = recompute, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.lin(x)
        if self.calls == 1:
            return x.sin().exp().sin()
        if self.recompute == "fewer":
            return x.sin().exp()
        return x.sin() * torch.tensor([1.0, 2.0])


@pytest.mark.parametrize("recompute", ["fewer", "other"])
@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_detects_non_determinism(mode: str, recompute: str) -> None:
    """test_checkpoint_detects_non_determinism: a recompute that differs from its forward is an error,
    never silently different gradients."""
    _, ckpt = twins(lambda: Holder(ChangesCourse(recompute)), ["block"], mode)
    out = ckpt(torch.randn(3, 2, requires_grad=True))
    pattern = "different number of tensors|different metadata|not found in storage"
    with pytest.raises(RuntimeError, match=re.compile(pattern)):
        out.sum().backward()


def _three_products(a: torch.Tensor) -> torch.Tensor:
    b = a * a
    a * b
    return torch.exp(a)


@pytest.mark.parametrize("mode", MODES)
def test_access_saved_tensor_twice_without_recomputation_works(mode: str) -> None:
    """test_access_saved_tensor_twice_without_recomputation_works: reading a saved tensor outside a
    backward recomputes the block each time; after the backward, it is gone."""
    _, ckpt = twins(lambda: Holder(Counted(_three_products)), ["block"], mode)
    a = torch.randn(5, requires_grad=True)
    d = ckpt(a)
    assert ckpt.block.calls == 1
    first = d.grad_fn._saved_result
    assert ckpt.block.calls == 2
    torch.testing.assert_close(d.grad_fn._saved_result, first, rtol=0, atol=0)
    assert ckpt.block.calls == 3
    d.sum().backward()
    assert ckpt.block.calls == 4
    torch.testing.assert_close(a.grad, torch.exp(a).detach(), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="after they have already been freed"):
        _ = d.grad_fn._saved_result
