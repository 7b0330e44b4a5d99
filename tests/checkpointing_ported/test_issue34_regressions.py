"""Issue 34's three reproducers, the fused step's double backward, and the buffer rule's cases.

Each was silently different under checkpointing (a second recompute starting from an input
the first one overwrote; running statistics other than BatchNorm's updated twice; one tensor
passed twice, copied apart). They must now give exactly the plain model's numbers in both
modes, or refuse with a one-sentence CheckpointError where no exact recompute exists.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from ported import EXACT, MODES, assert_same, check, observe, twins
from torch import nn

import memfit
from memfit.checkpointing import set_segments
from memfit.errors import CheckpointError
from memfit.levers.fused import FusedStep


class LeakyFirst(nn.Module):
    """Issue 34, reproducer 1: an in-place activation on the block's input."""

    def __init__(self) -> None:
        super().__init__()
        self.act, self.lin = nn.LeakyReLU(0.1, inplace=True), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.act(x))


class DoublesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(x.mul_(2)))


def _stack(block: type[nn.Module]) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(nn.Linear(8, 16), block(), block())


def _retain_twice(m: nn.Module) -> Any:
    out = m(torch.randn(4, 8)).sum()
    out.backward(retain_graph=True)
    out.backward()
    return out


def _grad_twice(m: nn.Module) -> Any:
    out = m(torch.randn(4, 8)).sum()
    params = list(m.parameters())
    first = torch.autograd.grad(out, params, retain_graph=True)
    second = torch.autograd.grad(out, params)
    for p, a, b in zip(params, first, second, strict=True):
        p.grad = a + b
    return first, second


def _two_losses(m: nn.Module) -> Any:
    h = m(torch.randn(4, 8))
    h.sum().backward(retain_graph=True)
    h.square().mean().backward()
    return h


BACKWARDS = {
    "retain_graph_twice": _retain_twice,
    "autograd_grad_twice": _grad_twice,
    "two_losses": _two_losses,
}


@pytest.mark.parametrize("backwards", list(BACKWARDS))
@pytest.mark.parametrize("block", [LeakyFirst, DoublesInput], ids=["leaky_relu_inplace", "mul_"])
@pytest.mark.parametrize("mode", MODES)
def test_reproducer_1_in_place_input_and_several_backwards(
    mode: str, block: type[nn.Module], backwards: str
) -> None:
    ref, got = check(_stack(block), ["1", "2"], mode, BACKWARDS[backwards])
    assert (got.grads["1.lin.weight"] - ref.grads["1.lin.weight"]).abs().max().item() == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_fused_step_with_clipping_is_exact(mode: str) -> None:
    """``FusedStep.backward(loss, clip_norm=...)`` backwards twice (norms, then the step)."""
    torch.manual_seed(0)
    plain = _stack(LeakyFirst)()
    weights = []
    for checkpointed in (False, True):
        model = copy.deepcopy(plain)
        if checkpointed:
            memfit.checkpoint(model, mode=mode, blocks=["1", "2"])
        fused = FusedStep(torch.optim.SGD(model.parameters(), lr=0.1))
        torch.manual_seed(1)
        norm = fused.backward(model(torch.randn(4, 8)).square().sum(), clip_norm=0.5)
        weights.append((norm, [p.detach().clone() for p in model.parameters()]))
        fused.remove()
    assert weights[1][0] == weights[0][0]
    for a, b in zip(weights[0][1], weights[1][1], strict=True):
        assert (a - b).abs().max().item() == 0.0


class InstanceNormBlock(nn.Module):
    """Issue 34, reproducer 2: running statistics that are not BatchNorm's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.InstanceNorm1d(8, track_running_stats=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.lin(x).unsqueeze(-1).expand(-1, -1, 3))).mean(-1)


def _steps(n: int, backwards: int = 1) -> Callable[[nn.Module], Any]:
    """``n`` forward/backward steps (the later ones use what the first call learned)."""

    def case(m: nn.Module) -> Any:
        outs = []
        for _ in range(n):
            out = m(torch.randn(5, 8)).sum()
            for k in range(backwards):
                out.backward(retain_graph=k < backwards - 1)
            outs.append(out)
        return outs

    return case


@pytest.mark.parametrize("mode", MODES)
def test_reproducer_2_instance_norm_statistics_once(mode: str) -> None:
    make = lambda: nn.Sequential(nn.Linear(8, 8), InstanceNormBlock(), InstanceNormBlock())  # noqa: E731
    ref, got = check(make, ["1", "2"], mode, _steps(3))
    assert (got.buffers["1.norm.running_mean"] - ref.buffers["1.norm.running_mean"]).abs().max().item() == 0.0


class Counter(nn.Module):
    """A step counter; ``reads`` scales the output by it (the recompute must see the forward's count)."""

    def __init__(self, reads: bool) -> None:
        super().__init__()
        self.lin, self.reads = nn.Linear(8, 8), reads
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step.add_(1)
        y = torch.tanh(self.lin(x))
        return y * self.step if self.reads else y


class Ema(nn.Module):
    """An exponential moving average of the activations; ``reads`` centres the output with it."""

    def __init__(self, reads: bool) -> None:
        super().__init__()
        self.lin, self.reads = nn.Linear(8, 8), reads
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * y.mean(0))
        return torch.tanh(y - self.ema) if self.reads else torch.tanh(y)


class Reassigned(nn.Module):
    """A buffer replaced by a new tensor in each forward (``self.seen = self.seen + 1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.seen + 1
        return torch.tanh(self.lin(x)) * self.seen


def _spectral() -> nn.Module:
    return nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8)), nn.Tanh())


def _batchnorm(momentum: float | None) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=momentum), nn.ReLU())


BUFFER_BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "spectral_norm_power_iteration": _spectral,
    "step_counter_written": lambda: Counter(reads=False),
    "step_counter_read": lambda: Counter(reads=True),
    "ema_written": lambda: Ema(reads=False),
    "ema_read": lambda: Ema(reads=True),
    "reassigned_buffer": Reassigned,
    "batchnorm": _batchnorm(0.1),
    "batchnorm_cumulative_average": _batchnorm(None),
}


@pytest.mark.parametrize(("mode", "backwards"), [("full", 1), ("full", 2), ("selective", 1)])
@pytest.mark.parametrize("kind", list(BUFFER_BLOCKS))
def test_every_buffer_a_forward_writes_is_written_once(mode: str, kind: str, backwards: int) -> None:
    """Buffers, outputs and gradients over three steps (one backward each, or two over one graph;
    selective checkpointing backwards once, see test_can_only_trigger_recompute_once)."""
    block = BUFFER_BLOCKS[kind]
    make = lambda: nn.Sequential(nn.Linear(8, 8), block(), block())  # noqa: E731
    ref, _ = check(make, ["1", "2"], mode, _steps(3, backwards))
    assert ref.buffers, "the block has buffers"


class QueryKey(nn.Module):
    """Issue 34, reproducer 3: called as ``block(h, h)``, it scales one argument in place."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q.mul_(0.5)
        return self.q(q) * k


class Aliased(nn.Module):
    def __init__(self, frozen_stem: bool = False, view: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8).requires_grad_(not frozen_stem)
        self.blocks = nn.ModuleList([QueryKey(), QueryKey()])
        self.view = view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h, h[:, :8] if self.view else h)
        return h


@pytest.mark.parametrize("backwards", [1, 2])
@pytest.mark.parametrize("variant", ["same_tensor", "a_view", "frozen_stem"])
@pytest.mark.parametrize("mode", MODES)
def test_reproducer_3_one_tensor_passed_twice(mode: str, variant: str, backwards: int) -> None:
    def make() -> nn.Module:
        return Aliased(frozen_stem=variant == "frozen_stem", view=variant == "a_view")

    def case(m: nn.Module) -> Any:
        x = torch.randn(5, 4, requires_grad=True)
        out = m(x).sum()
        for k in range(backwards):
            out.backward(retain_graph=k < backwards - 1)
        return out, x.grad

    if mode == "selective" and backwards == 2:
        # PyTorch's own limitation: see test_can_only_trigger_recompute_once
        _, ckpt = twins(make, ["blocks.0", "blocks.1"], mode)
        with pytest.raises(CheckpointError, match=r"^selective checkpointing of QueryKey keeps the outputs"):
            case(ckpt)
        return
    ref, got = check(make, ["blocks.0", "blocks.1"], mode, case)
    if variant != "frozen_stem":
        assert (got.grads["stem.weight"] - ref.grads["stem.weight"]).abs().max().item() == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_a_later_backward_after_one_that_freed_the_input_copy_refuses(mode: str) -> None:
    """A partial backward without retain_graph=True recomputes from the pristine input copy and
    overwrites it; a later backward through the same block refuses instead of using it."""

    class TwoStage(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = x.mul_(2).sin().cos()
            return y, y.sin().cos()

    model = memfit.checkpoint(nn.Sequential(nn.Linear(3, 3), TwoStage()), blocks=["1"], mode=mode)
    x = torch.randn(3, 3)
    y, z = model(x)
    (grad_y,) = torch.autograd.grad(z, (y,), torch.ones(3, 3))
    with pytest.raises(
        CheckpointError, match=r"^the checkpointed block TwoStage wrote into its input .* retain_graph=True"
    ):
        torch.autograd.grad(y, list(model[0].parameters()), grad_y)


class ChangesCourse(nn.Module):
    """Writes a counter and, once ``reads`` is set, reads it after writing it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.reads = nn.Linear(8, 8), False
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step.add_(1)
        y = torch.tanh(self.lin(x))
        return y * self.step if self.reads else y


@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_read_after_an_uncopied_write_refuses_then_is_kept(mode: str) -> None:
    _, model = twins(lambda: nn.Sequential(nn.Linear(8, 8), ChangesCourse()), ["1"], mode)
    for _ in range(2):  # the counter is written, never read
        model(torch.randn(5, 8)).sum().backward()
    model[1].reads = True
    out = model(torch.randn(5, 8)).sum()  # the forward changes course: reads what it wrote, uncopied
    with pytest.raises(
        CheckpointError, match=r"^the checkpointed block ChangesCourse read its buffer 'step'"
    ):
        out.backward()
    plain = copy.deepcopy(model)
    memfit.uncheckpoint(plain)
    assert_same(observe(plain, _steps(2)), observe(model, _steps(2)), EXACT)  # now kept: exact


class Counter16(Counter):
    def __init__(self) -> None:
        super().__init__(reads=True)
        self.lin = nn.Linear(16, 16)


@pytest.mark.parametrize("backwards", [1, 2])
def test_segments_get_the_same_protections(backwards: int) -> None:
    """A segment (blocks checkpointed as one, full) writing its input in place, with BatchNorm and a
    counter it reads, backwarded once or twice."""

    def case(m: nn.Module) -> Any:
        out = m(torch.randn(4, 8)).sum()
        for k in range(backwards):
            out.backward(retain_graph=k < backwards - 1)
        return out

    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Linear(8, 16), LeakyFirst(), LeakyFirst(), nn.Sequential(nn.BatchNorm1d(16), Counter16())
    )
    segmented = set_segments(copy.deepcopy(plain), [["1", "2", "3"]])
    for _ in range(2):
        assert_same(observe(plain, case), observe(segmented, case), EXACT)


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_contexts_apply_the_buffer_rule(mode: str) -> None:
    """``checkpoint_contexts`` (for callers of ``torch.utils.checkpoint``) put written buffers back too."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    from memfit.checkpointing import checkpoint_contexts

    torch.manual_seed(0)
    plain = InstanceNormBlock()
    block = copy.deepcopy(plain)
    x = torch.randn(5, 8, requires_grad=True)
    plain(x).sum().backward()
    out = torch_checkpoint(block, x, use_reentrant=False, context_fn=lambda: checkpoint_contexts(block, mode))
    out.sum().backward()
    for name, buf in plain.named_buffers():
        torch.testing.assert_close(dict(block.named_buffers())[name], buf, **EXACT)
    torch.testing.assert_close(block.lin.weight.grad, plain.lin.weight.grad, **EXACT)
