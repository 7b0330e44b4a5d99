"""The stem's tensors a checkpoint keeps (Note [stem tensors a checkpoint holds], memfit/measuring/phases.py).

With a frozen embedding and frozen norms (an adapter's base), a plain step keeps nothing of
the embedding's output: no backward reads it. A checkpointed first block keeps it as its
input until its backward. The profile, measured with every block in one mode, must
predict both, and plans mixing modes, to the byte of MemTracker's peak.
"""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit.checkpointing import set_block_modes, uncheckpoint
from memfit.models.llama import llama
from memfit.stepmodel import simulate


def _adapter_like(seed: int = 0) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """The built-in LLaMA with its embedding, norms and head frozen (the linears train)."""
    torch.manual_seed(seed)
    spec = llama(preset="tiny", n_layer=3, n_embd=64, n_head=4, vocab_size=300, block_size=256)
    model = spec.model
    for name, p in model.named_parameters():
        if "tok_emb" in name or "norm" in name or name.startswith("head"):
            p.requires_grad_(False)
    return model, spec.random_batch(2, seed=1), spec.loss_fn


def _trainable(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def _measured(model: torch.nn.Module, batch, loss_fn, modes: dict[str, str]) -> int:  # type: ignore[no-untyped-def]
    set_block_modes(model, modes)
    try:
        return memfit.measure(model, batch, loss_fn, _trainable(model), steps=1).peak_bytes
    finally:
        uncheckpoint(model)


@pytest.mark.parametrize(
    "modes",
    [("full", "full", "full"), ("full", "none", "none"), ("full", "full", "none"), ("none",) * 3],
    ids=lambda m: "-".join(m),
)
def test_a_frozen_stem_kept_by_the_first_checkpoint_is_predicted_to_the_byte(modes: tuple[str, ...]) -> None:
    model, batch, loss_fn = _adapter_like()
    prof = memfit.profile(model, batch, loss_fn, _trainable(model), repeats=1)
    first = prof.blocks[0]
    # the plain step keeps none of the embedding's output; a checkpointed first block keeps it
    assert first.stem_saved_bytes.get("full", 0) == batch[0].numel() * 64 * 4
    assert "none" not in first.stem_saved_bytes
    names = [b.name for b in prof.blocks]
    plan = dict(zip(names, modes, strict=True))
    assert simulate(prof, plan).peak_bytes == _measured(model, batch, loss_fn, plan)
