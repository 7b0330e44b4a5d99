"""PyTorch's ``test/test_utils.py`` TestCheckpoint, its CPU cases ported to ``memfit.checkpoint``.

Each test names the peer test it ports. The peer checkpoints a function or a chunk of an
``nn.Sequential``; here the same computation is a block of a model and memfit checkpoints
it, in full and in selective mode, and the harness compares outputs, gradients, buffers
and the RNG stream with the plain model's, exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ported import MODES, Counted, check, observe, twins
from torch import nn

from memfit.errors import CheckpointError


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20)),
        nn.Sequential(nn.ReLU(), nn.Linear(20, 5), nn.ReLU()),
    )


class Doubler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * torch.tensor(2.0)  # the constant is saved for backward, so the block recomputes


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_trigger(mode: str) -> None:
    """test_checkpoint_trigger: each checkpointed block's forward runs once more in backward, the
    others once."""
    plain, ckpt = twins(
        lambda: nn.Sequential(*[Doubler() for _ in range(10)]), [str(i) for i in range(5)], mode
    )
    seen = []
    for model in (plain, ckpt):

        def case(m: nn.Module) -> Any:
            x = torch.randn(3, 4, requires_grad=True)
            out = m(x)
            assert [b.calls for b in m] == [1] * 10
            out.sum().backward()
            return x.grad

        seen.append(observe(model, case))
    torch.testing.assert_close(seen[1].values, seen[0].values, rtol=0, atol=0)
    assert [b.calls for b in ckpt] == [2] * 5 + [1] * 5
    assert [b.calls for b in plain] == [1] * 10


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_valid(mode: str) -> None:
    """test_checkpoint_valid: gradients with create_graph=True, then (full) a backward through them.

    Selective checkpointing keeps its saved outputs for one backward only, a limitation of
    PyTorch's own selective checkpointing (it raises "Trying to backward an extra time" for
    a backward through create_graph gradients); memfit raises a CheckpointError naming the block.
    """

    def first(m: nn.Module) -> Any:
        x = torch.randn(1, 100, requires_grad=True)
        out = m(x)
        (g,) = torch.autograd.grad(out, x, torch.ones(1, 5), create_graph=True)
        return out, g, x

    def case(m: nn.Module) -> Any:
        out, g, x = first(m)
        g.square().sum().backward()
        return out, g, x.grad

    if mode == "full":
        check(_mlp, ["0", "1"], mode, case)
        return
    check(_mlp, ["0", "1"], mode, lambda m: first(m)[:2])
    _, ckpt = twins(_mlp, ["0", "1"], mode)
    _, g, _ = first(ckpt)
    with pytest.raises(
        CheckpointError, match=r"^selective checkpointing of Sequential keeps .* use mode 'full'"
    ):
        g.square().sum().backward()


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint(mode: str) -> None:
    """test_checkpoint: checkpoint_sequential's two chunks of a Linear/ReLU stack, as two blocks."""

    def case(m: nn.Module) -> Any:
        x = torch.randn(1, 100, requires_grad=True)
        out = m(x)
        out.sum().backward()
        return out, x.grad

    check(_mlp, ["0", "1"], mode, case)


class ModuleListNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        widths = [(100, 50), (50, 20), (20, 5)]
        self.module_list = nn.ModuleList(m for a, b in widths for m in (nn.Linear(a, b), nn.ReLU()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.module_list:
            x = layer(x)
        return x


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_module_list(mode: str) -> None:
    """test_checkpoint_module_list: layers in a ModuleList the forward loops over."""

    def case(m: nn.Module) -> Any:
        x = torch.randn(1, 100, requires_grad=True)
        out = m(x)
        out.sum().backward()
        return out, x.grad

    check(ModuleListNet, ["module_list.0", "module_list.2", "module_list.4"], mode, case)


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_rng_cpu(mode: str) -> None:
    """test_checkpoint_rng_cpu: dropout before and inside the block; five steps; same masks, same stream."""

    def make() -> nn.Module:
        return nn.Sequential(nn.Dropout(), nn.Sequential(nn.Linear(8, 8), nn.Dropout()))

    def case(m: nn.Module) -> Any:
        grads = []
        for _ in range(5):
            x = torch.randn(2000, 8, requires_grad=True)
            m(x).sum().backward()
            grads.append(x.grad)
        return grads

    check(make, ["1"], mode, case)


class Optional2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(100, 100)

    def forward(self, t1: torch.Tensor, t2: torch.Tensor | None = None) -> torch.Tensor:
        t1 = torch.tanh(self.lin(t1))
        return t1 if t2 is None else t1 + t2


class Holder(nn.Module):
    """A model whose one block is called as the peer calls its function."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.block(*args, **kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_non_tensor(mode: str) -> None:
    """test_checkpoint_non_tensor: a None argument, then a tensor in its place."""

    def case(m: nn.Module) -> Any:
        x = torch.randn(1, 100, requires_grad=True)
        m(x, None).sum().backward()
        y = torch.randn(1, 100, requires_grad=True)
        m(x, y).sum().backward()
        return x.grad, y.grad

    check(lambda: Holder(Optional2()), ["block"], mode, case)


class Mixed(nn.Module):
    """The peer's ``foo``: tensors and non-tensors in and out, in-place ops on intermediates."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(10))

    def forward(self, t1: Any, t2: Any, scale: Any, t3: Any) -> tuple[Any, ...]:
        t4 = t1 + t2 * t3 * self.w
        t5 = t1 * t2 + t3
        t4 *= scale
        t5 *= scale
        return scale, t4, None, True, t5, "bar", t1


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_non_tensor_inputs_outputs(mode: str) -> None:
    """test_checkpoint_non_tensor_inputs_outputs: mixed outputs, three backwards over one graph
    (two with retain_graph=True), the input itself returned."""

    def case(m: nn.Module) -> Any:
        t1, t2, t3 = torch.rand(10, requires_grad=True), torch.rand(10, requires_grad=True), torch.rand(10)
        res = m(t1 * 1, t2, 7, t3)
        res[1].sum().backward(retain_graph=True)
        res[4].sum().backward(retain_graph=True)
        res[6].sum().backward()
        return res, t1.grad, t2.grad

    check(lambda: Holder(Mixed()), ["block"], mode, case)


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_no_tensors(mode: str) -> None:
    """test_checkpoint_no_tensors: Python numbers in, Python numbers out."""

    def foo(t1: float, t2: float, scale: int, t3: float) -> tuple[Any, ...]:
        t4 = (t1 + t2 * t3) * scale
        t5 = (t1 * t2 + t3) * scale
        return scale, t4, None, True, t5, "bar", t1

    def make() -> nn.Module:
        model = Holder(nn.Linear(4, 4))
        model.numbers = Counted(foo)
        return model

    check(
        make, ["block", "numbers"], mode, lambda m: (m.numbers(0.25, 0.5, 3, 0.75), m(torch.ones(2, 4)).sum())
    )


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, t1: torch.Tensor, t2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(t1), t2  # the second is used by other application logic


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_partial_grad(mode: str) -> None:
    """test_checkpoint_partial_grad: an output that does not require grad, and a backward through
    one output."""

    def case(m: nn.Module) -> Any:
        t1, t2 = torch.randn(1, 4, requires_grad=True), torch.randn(1, 4)
        out = m(t1, t2)
        out[0].sum().backward()
        return out, t1.grad

    check(lambda: Holder(Pair()), ["block"], mode, case)
