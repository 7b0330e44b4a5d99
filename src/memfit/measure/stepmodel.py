"""Add a Profile's numbers up to the peak of one step: the formula in ``Profile``'s docstring.

A profile is taken with every block in one mode; a plan mixes modes. :func:`step_peak`
predicts the peak for any assignment of modes to blocks, without running the model, and
splits it by role: parameters, gradients, optimizer state, activations kept for backward,
and the transient bytes on top of them at that moment.

Trade-off: blocks are assumed not to change each other's numbers (each number is taken at
the block's own boundaries); the tests check the prediction against measured peaks for
uniform and mixed modes.

Example:
    >>> import torch
    >>> from memfit.measure.profile import profile
    >>> from memfit.train.gpt import GPT, GPTConfig, gpt_loss
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> x = torch.randint(0, 256, (2, 16))
    >>> prof = profile(model, (x, x), gpt_loss, repeats=1)
    >>> peak, parts = step_peak(prof, "none")
    >>> peak == prof.measured_peak_bytes == sum(parts.values())
    True
"""

from __future__ import annotations

from collections.abc import Mapping

from memfit.errors import ConfigError
from memfit.records import BREAKDOWN_KEYS, CHECKPOINT_MODES, Profile

__all__ = ["step_peak"]


def step_peak(prof: Profile, modes: str | Mapping[str, str]) -> tuple[int, dict[str, int]]:
    """Predicted peak bytes of one step and its split into :data:`BREAKDOWN_KEYS`.

    Args:
        prof: a profile (measured or estimated).
        modes: one mode for every block, or ``{block name: mode}`` (blocks not named: none).

    Returns:
        ``(peak_bytes, breakdown)``; the breakdown adds up to the peak. ``activations`` is
        what the forward keeps for backward at that moment, ``temporaries`` the transient
        bytes above it.
    """
    if isinstance(modes, str):
        chosen = [modes] * len(prof.blocks)
    else:
        chosen = [modes.get(b.name, "none") for b in prof.blocks]
    bad = sorted({m for m in chosen if m not in CHECKPOINT_MODES})
    if bad:
        raise ConfigError(f"unknown checkpointing mode(s) {bad}; use one of {', '.join(CHECKPOINT_MODES)}.")
    out_mode = chosen[0] if chosen else (modes if isinstance(modes, str) else "none")
    out = prof.outside
    saved = [b.saved_bytes[m] for b, m in zip(prof.blocks, chosen, strict=True)]
    held = [b.held_bytes.get(m, b.saved_bytes[m]) for b, m in zip(prof.blocks, chosen, strict=True)]
    cands: list[dict[str, int]] = [
        {"grads": prof.grad_bytes, "activations": 0, "temporaries": prof.optimizer_temp_bytes},
        {"grads": 0, "activations": sum(held), "temporaries": out.forward_peak_bytes.get(out_mode, 0)},
        {"grads": 0, "activations": sum(saved), "temporaries": out.backward_peak_bytes.get(out_mode, 0)},
    ]
    later = prof.early_grad_bytes + sum(b.grad_bytes for b in prof.blocks)
    fw_kept, bw_kept = prof.outside_before_bytes, prof.outside_before_kept_bytes
    for b, m, s, h in zip(prof.blocks, chosen, saved, held, strict=True):
        later -= b.grad_bytes
        cands.append({"grads": 0, "activations": fw_kept, "temporaries": b.forward_peak_bytes[m]})
        fw_kept += h
        bw_kept += s
        cands.append({"grads": later, "activations": bw_kept, "temporaries": b.backward_peak_bytes[m]})
    all_grads = prof.early_grad_bytes + sum(b.grad_bytes for b in prof.blocks)
    cands.append({"grads": all_grads, "activations": 0, "temporaries": prof.outside_before_backward_bytes})
    best = max(cands, key=lambda c: sum(c.values()))
    parts = {"params": prof.param_bytes, "optimizer": prof.optimizer_bytes, **best}
    return sum(parts.values()), {k: int(parts[k]) for k in BREAKDOWN_KEYS}
