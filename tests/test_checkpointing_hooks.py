"""Selective checkpointing inside saved-tensor hooks (``save_on_cpu``, the offload lever's).

See Note [selective checkpointing and saved-tensor hooks] in memfit/checkpointing/policy.py:
memfit sets ``respect_saved_tensors_hooks`` where torch has it (2.14 and newer), so the
outputs selective checkpointing keeps go through the hooks in scope, torch raises no
FutureWarning, and the gradients are those of the model without checkpointing.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

import memfit
from memfit.levers.offload import offload_blocks

#: float32 on a CPU: checkpointing replays the same ops, so the gradients agree to rounding.
EXACT = {"rtol": 1e-6, "atol": 1e-7}
#: Whether this torch lets a caller route what selective checkpointing keeps through the hooks.
ROUTES = "respect_saved_tensors_hooks" in (torch_checkpoint.checkpoint.__doc__ or "")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3)])


def _grads(model: nn.Module, x: torch.Tensor, hooks: object | None) -> list[torch.Tensor]:
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning at all fails the test
        with hooks if hooks is not None else torch.enable_grad():  # type: ignore[attr-defined]
            loss = model(x).square().mean()
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _packing() -> tuple[list[tuple[int, ...]], object]:
    """A saved_tensors_hooks context that records the shape of every tensor it packs."""
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t.clone()  # a copy, as save_on_cpu makes: the unpacked value is the copy

    return shapes, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def test_selective_inside_save_on_cpu_is_exact_and_silent() -> None:
    x = torch.randn(8, 16)
    reference = _model()
    want = _grads(reference, x, None)
    model = memfit.checkpoint(copy.deepcopy(reference), mode="selective")
    got = _grads(model, x, torch.autograd.graph.save_on_cpu())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **EXACT)


def test_offload_lever_beside_selective_is_exact_and_silent() -> None:
    x = torch.randn(8, 16)
    reference = _model()
    want = _grads(reference, x, None)
    model = memfit.checkpoint(copy.deepcopy(reference), mode="selective")
    offload_blocks(model, ["0", "1", "2"])  # save_on_cpu around each block, as the lever runs it
    got = _grads(model, x, None)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **EXACT)


def test_what_selective_keeps_goes_through_the_hooks() -> None:
    x = torch.randn(8, 16)
    model = memfit.checkpoint(_model(), mode="selective")
    shapes, hooks = _packing()
    _grads(model, x, hooks)
    # Selective keeps each block's two matmul outputs, (8, 32) and (8, 16); outside the blocks,
    # square() saves the model's output, (8, 16).
    counts = (shapes.count((8, 32)), shapes.count((8, 16)))
    if ROUTES:  # packed by the hooks, so save_on_cpu offloads them
        assert counts == (3, 3 + 1), shapes
    else:  # torch 2.13: kept outside the graph, bypassing the hooks (PyTorch's legacy behaviour)
        assert counts == (0, 1), shapes


@pytest.mark.skipif(not ROUTES, reason="this torch has no respect_saved_tensors_hooks")
def test_torch_itself_still_warns_without_the_choice() -> None:
    # The test above is silent because memfit chooses, not because torch stopped warning.
    m = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    contexts = torch_checkpoint.create_selective_checkpoint_contexts(
        lambda ctx, op, *a, **k: torch_checkpoint.CheckpointPolicy.MUST_SAVE
    )
    with pytest.warns(FutureWarning, match="respect_saved_tensors_hooks"), torch.autograd.graph.save_on_cpu():
        torch_checkpoint.checkpoint(m, x, use_reentrant=False, context_fn=lambda: contexts)
