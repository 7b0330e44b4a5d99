"""PyTorch's ``test/test_autograd.py`` TestNestedCheckpoint and TestSelectiveActivationCheckpoint,
ported to ``memfit.checkpoint``.

Nested checkpointing is a checkpointed block inside a checkpointed block (memfit checkpoints
both). Higher-order gradients (a backward through gradients taken with
``create_graph=True``) are exact under full checkpointing; selective checkpointing keeps
the outputs it saves for one backward only, a limitation of PyTorch's own selective
checkpointing ("Trying to backward an extra time"), for which memfit raises a
CheckpointError that names the block: the tests below say so where they meet it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from ported import MODES, Counted, check, observe, twins
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from memfit.errors import CheckpointError

#: The start of memfit's refusal of a second backward through a selectively checkpointed block.
SECOND_BACKWARD = r"^selective checkpointing of \w+ keeps the outputs it saves for one backward only"


def _grad(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The peer's ``grad`` helper: the gradient of ``fn`` at x, with a graph (for the next order)."""

    def wrapper(x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            out = fn(x)
            (g,) = torch.autograd.grad(out.sum(), inputs=(x,), create_graph=True)
        return g

    return wrapper


def _f(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp().sin()


def _g(x: torch.Tensor) -> torch.Tensor:
    """Takes gradients inside its own forward, as the peer's ``g`` does."""
    a = x.sin().exp().sin()
    b = x.sin().exp().sin()
    torch.autograd.grad(a.sum(), x, create_graph=True)
    torch.autograd.grad(b.sum(), x, create_graph=True)
    return x.sin()


class Nest(nn.Module):
    """A checkpointed block (``outer``) whose function runs through a checkpointed child (``outer.inner``)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.outer = Counted(lambda x: self.outer.inner(x))
        self.outer.inner = Counted(fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(x)


def _orders(m: nn.Module, x: torch.Tensor, orders: int) -> list[torch.Tensor]:
    fn: Callable[[torch.Tensor], torch.Tensor] = m
    values = [m(x)]
    for _ in range(orders):
        fn = _grad(fn)
        values.append(fn(x))
    return values


@pytest.mark.parametrize("fn", [_f, _g], ids=["f", "g_with_grads_inside"])
@pytest.mark.parametrize("mode", MODES)
def test_nested_checkpoint(mode: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """test_nested_checkpoint: a checkpoint inside a checkpoint; the value and gradients of order 1 to 3
    (nothing here is kept by selective checkpointing, so it too recomputes for every order)."""

    def case(m: nn.Module) -> Any:
        return _orders(m, torch.randn(3, 3).requires_grad_(), 3)

    check(lambda: Nest(fn), ["outer", "outer.inner"], mode, case)


class TwoChildren(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f, self.g = Counted(_f), Counted(lambda x: x.cos().sin().exp())
        self.h = Counted(lambda x: self.g(self.f(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.h(x)


@pytest.mark.parametrize("mode", MODES)
def test_nested_checkpoint_two_children(mode: str) -> None:
    """test_nested_checkpoint_two_children: a checkpointed block running two checkpointed children."""
    check(TwoChildren, ["h", "f", "g"], mode, lambda m: _orders(m, torch.randn(3, 3).requires_grad_(), 2))


def _with_numbers(k: int, a: torch.Tensor, b: torch.Tensor, f: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return f(k * a * b.exp()), 1, "abcd"


class Holder(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.block(*args, **kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_nested_checkpoint_non_tensor_inputs_and_outputs(mode: str) -> None:
    """test_nested_checkpoint_non_tensor_inputs_and_outputs: a number and a function in, numbers out."""

    def case(m: nn.Module) -> Any:
        a, b = torch.tensor(2.0, requires_grad=True), torch.tensor(3.0, requires_grad=True)
        out = m(3, a, b, torch.sin)
        return out, torch.autograd.grad(out[0], (a, b))

    check(lambda: Holder(Counted(_with_numbers)), ["block"], mode, case)


def _kw(a: torch.Tensor, blah: torch.Tensor | None = None) -> torch.Tensor:
    out = a.sin().exp()
    if blah is not None:
        out = out * blah
    return out.sin().exp()


@pytest.mark.parametrize("mode", MODES)
def test_nested_checkpoint_kwargs(mode: str) -> None:
    """test_nested_checkpoint_kwargs: a tensor passed by keyword."""

    def case(m: nn.Module) -> Any:
        a, b = torch.tensor(2.0, requires_grad=True), torch.tensor(3.0, requires_grad=True)
        return torch.autograd.grad(m(a, blah=b), (a, b))

    check(lambda: Holder(Counted(_kw)), ["block"], mode, case)


@pytest.mark.parametrize("mode", MODES)
def test_nested_checkpoint_same_graph(mode: str) -> None:
    """test_nested_checkpoint_same_graph: a hook on the forward's graph runs once in the backward."""

    def case(m: nn.Module) -> Any:
        count = [0]
        out = m(torch.tensor(1.0, requires_grad=True))
        out.grad_fn.next_functions[0][0].register_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        out.backward()
        return count[0]

    _, got = check(lambda: Holder(Counted(lambda a: a.sin().cos().sin())), ["block"], mode, case)
    assert got.values == 1


def _x_and_out(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = a.sin().cos()
    return x, x.sin()


@pytest.mark.parametrize("mode", MODES)
def test_nested_checkpoint_reentrant_backwards(mode: str) -> None:
    """test_nested_checkpoint_reentrant_backwards: a hook in the backward runs another backward
    (retain_graph=True) over part of the same graph."""

    def case(m: nn.Module) -> Any:
        a = torch.tensor(1.0, requires_grad=True)
        x, out = m(a)
        out.grad_fn.register_hook(lambda *_: x.backward(retain_graph=True))
        out.backward(retain_graph=True)
        return a.grad

    check(lambda: Holder(Counted(_x_and_out)), ["block"], mode, case)


@pytest.mark.parametrize("mode", MODES)
def test_nested_checkpoint_set_early_stop(mode: str) -> None:
    """test_nested_checkpoint_set_early_stop (the default, early stop on): the recompute stops once it
    has what the backward needs, so a last op that saves nothing is not run again."""
    clones = [0]

    def counted_clone(x: torch.Tensor) -> torch.Tensor:
        clones[0] += 1
        return x.clone()

    def case(m: nn.Module) -> Any:
        a = torch.tensor(1.0, requires_grad=True)
        m(a).backward()
        return a.grad

    _, ckpt = twins(lambda: Holder(Counted(lambda x: counted_clone(x.sin().cos()))), ["block"], mode)
    observe(ckpt, case)
    assert clones[0] == 1 and ckpt.block.calls == 2


@pytest.mark.parametrize("mode", MODES)
def test_nested_checkpoint_set_early_stop_no_recompution_needed(mode: str) -> None:
    """test_nested_checkpoint_set_early_stop_no_recompution_needed (case 2): a forward that saves no
    tensor is never recomputed."""
    _, ckpt = twins(lambda: Holder(Counted(lambda x: x.clone())), ["block"], mode)
    a = torch.tensor(1.0, requires_grad=True)
    ckpt(a).backward()
    assert ckpt.block.calls == 1 and a.grad == 1.0


class MmBlock(nn.Module):
    def __init__(self, n: int = 64) -> None:
        super().__init__()
        self.y = nn.Parameter(torch.randn(n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x.cos(), self.y).sin().sum()


@pytest.mark.parametrize("mode", MODES)
def test_flops_and_mem(mode: str) -> None:
    """test_flops_and_mem (the FLOPs half, which runs on a CPU): a backward costs the plain model's two
    matmuls, plus one recomputed matmul under full checkpointing and none under selective."""

    def backward_flops(m: nn.Module) -> int:
        out = m(torch.randn(64, 64, requires_grad=True))
        with FlopCounterMode(display=False) as counter:
            out.backward()
        return int(counter.get_total_flops())

    check(lambda: Holder(MmBlock()), ["block"], mode, lambda m: m(torch.randn(64, 64)))
    plain, ckpt = twins(lambda: Holder(MmBlock()), ["block"], mode)
    matmul = 2 * 64**3
    assert backward_flops(plain) == 2 * matmul
    assert backward_flops(ckpt) == (3 if mode == "full" else 2) * matmul


@pytest.mark.parametrize("mode", MODES)
def test_output_already_has_autograd_meta(mode: str) -> None:
    """test_output_already_has_autograd_meta: an integer view among the outputs."""

    def case(m: nn.Module) -> Any:
        x, y = torch.tensor([1, 2, 3]), torch.randn(3, requires_grad=True)
        out = m(x, y)
        out[1].sum().backward()
        return out, y.grad

    check(lambda: Holder(Counted(lambda x, y: (x.view(-1), y.sin().cos()))), ["block"], mode, case)


class KeptThenWritten(nn.Module):
    """A matmul output (kept by selective checkpointing) written in place, as the peer's ``sin().mul_(2)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).mul_(2).cos().exp()


@pytest.mark.parametrize("mode", MODES)
def test_version_counter(mode: str) -> None:
    """test_version_counter: PyTorch's selective checkpointing refuses a kept output mutated in place
    unless told to allow it; memfit copies it before the write, and the gradients are exact."""

    def case(m: nn.Module) -> Any:
        x = torch.randn(3, requires_grad=True)
        m(x).sum().backward()
        return x.grad

    check(lambda: Holder(KeptThenWritten()), ["block"], mode, case)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


@pytest.mark.parametrize("mode", MODES)
def test_function_with_more_than_one_output(mode: str) -> None:
    """test_function_with_more_than_one_output: a kept op with several outputs (CPU attention returns the
    output and its log-sum-exp), as the peer's var_mean."""

    def case(m: nn.Module) -> Any:
        x = torch.randn(2, 5, 8, requires_grad=True)
        return torch.autograd.grad(m(x), (x,))

    check(lambda: Holder(Attention()), ["block"], mode, case)


@pytest.mark.parametrize("mode", MODES)
def test_can_only_trigger_recompute_once(mode: str) -> None:
    """test_can_only_trigger_recompute_once: two backwards over one graph. PyTorch's selective
    checkpointing refuses the second ("Trying to backward an extra time"); memfit says so in a
    CheckpointError naming the block. Full checkpointing recomputes once per backward, exactly."""

    def case(m: nn.Module) -> Any:
        x = torch.randn(3, requires_grad=True)
        out = m(x)
        out.sum().backward(retain_graph=True)
        out.sum().backward(retain_graph=True)
        return x.grad

    make = lambda: Holder(Counted(lambda x: (x @ torch.ones(3, 3)).cos().exp(), 3))  # noqa: E731
    if mode == "full":
        check(make, ["block"], mode, case)
        return
    _, ckpt = twins(make, ["block"], mode)
    out = ckpt(torch.randn(3, requires_grad=True))
    out.sum().backward(retain_graph=True)
    with pytest.raises(CheckpointError, match=SECOND_BACKWARD) as info:
        out.sum().backward(retain_graph=True)
    assert "Trying to backward an extra time" in str(info.value.__cause__)
