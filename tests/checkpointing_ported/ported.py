"""The harness the ported checkpointing suites share: a plain model and memfit's checkpointed copy,
the same case run on each from the same seed and weights, and everything compared.

A *case* is a function of the model that builds its inputs (after the seed is set), runs
forwards and backwards as the peer's test does, and returns what it wants compared
(outputs, input gradients, counters). The harness adds the parameters' gradients, the
buffers and the global RNG state after the case (a recompute must not advance the stream).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import memfit
from memfit.checkpointing import checkpointed_blocks

#: The recompute replays the very same CPU kernels on the very same values: no difference at all.
EXACT = {"rtol": 0.0, "atol": 0.0}
MODES = ["full", "selective"]
Case = Callable[[nn.Module], Any]


@dataclass
class Seen:
    """What one run of a case left behind."""

    values: Any
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    rng: torch.Tensor


def twins(
    make: Callable[[], nn.Module], blocks: Sequence[str] | str, mode: str, seed: int = 0
) -> tuple[nn.Module, nn.Module]:
    """The plain model and a checkpointed deep copy (same weights)."""
    torch.manual_seed(seed)
    plain = make()
    ckpt = memfit.checkpoint(copy.deepcopy(plain), blocks=blocks, mode=mode)  # type: ignore[arg-type]
    assert checkpointed_blocks(ckpt), "nothing was checkpointed"
    return plain, ckpt


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_detached(v) for v in value)
    return value


def observe(model: nn.Module, case: Case, seed: int = 1) -> Seen:
    """Run ``case`` on ``model`` from ``seed``; keep what it returned and what it left."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    values = _detached(case(model))
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return Seen(values, grads, buffers, torch.get_rng_state())


def assert_same_values(ref: Any, got: Any, tol: dict[str, float], where: str = "value") -> None:
    if isinstance(ref, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        torch.testing.assert_close(got, ref, **tol, msg=lambda m: f"{where}: {m}")
    elif isinstance(ref, dict):
        assert isinstance(got, dict) and got.keys() == ref.keys(), where
        for k in ref:
            assert_same_values(ref[k], got[k], tol, f"{where}[{k!r}]")
    elif isinstance(ref, list | tuple):
        assert type(got) is type(ref) and len(got) == len(ref), where
        for i, (r, g) in enumerate(zip(ref, got, strict=True)):
            assert_same_values(r, g, tol, f"{where}[{i}]")
    else:
        assert got == ref, f"{where}: {got!r} != {ref!r}"


def assert_same(ref: Seen, got: Seen, tol: dict[str, float] = EXACT) -> None:
    """Outputs, gradients, buffers and the RNG stream of the checkpointed run equal the plain run's."""
    assert_same_values(ref.values, got.values, tol)
    assert got.grads.keys() == ref.grads.keys()
    assert_same_values(ref.grads, got.grads, tol, "grad")
    assert_same_values(ref.buffers, got.buffers, tol, "buffer")
    assert torch.equal(got.rng, ref.rng), "the checkpointed run advanced the RNG stream differently"


def check(
    make: Callable[[], nn.Module],
    blocks: Sequence[str] | str,
    mode: str,
    case: Case,
    tol: dict[str, float] = EXACT,
) -> tuple[Seen, Seen]:
    """Run ``case`` on the plain model and on its checkpointed twin, assert they agree, return both."""
    plain, ckpt = twins(make, blocks, mode)
    ref, got = observe(plain, case), observe(ckpt, case)
    assert_same(ref, got, tol)
    return ref, got


class Counted(nn.Module):
    """Wraps a function of tensors as a block, counting how often its forward runs."""

    def __init__(self, fn: Callable[..., Any], width: int = 0) -> None:
        super().__init__()
        self.fn = fn
        self.calls = 0
        self.lin = nn.Linear(width, width) if width else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.lin is not None:
            args = (self.lin(args[0]), *args[1:])
        return self.fn(*args, **kwargs)
