"""Applying a decision: :func:`apply` (``memfit.apply``), :func:`applied` (the same, undone
after its body), and the levers, one object each, listed once in :mod:`.registry`.

A lever (:class:`~memfit.applying.lever.Lever`) owns, in its module, its name and risk, when
it is refused, what must be measured for it, how it changes the step model's profile, the
settings the planner searches and how it is applied and undone:

- :mod:`.fused_step`: the optimizer step fused into the backward (exact);
- :mod:`.state`: ``state_bf16`` / ``state_8bit`` / ``state_4bit``, Adam's moments in fewer bits;
- :mod:`.weights_bf16`: bf16 weights without an fp32 master copy;
- :mod:`.offload`: chosen blocks' saved activations in host memory (CUDA only);
- :mod:`.chunked_loss`: the loss head in chunks of tokens;
- :mod:`.frozen`: ``frozen_bf16`` / ``frozen_nf4``, the frozen weights in bf16 or NF4.

What each does to tensors and modules is :mod:`memfit.levers`; docs/ARCHITECTURE.md shows how
to add a lever.
"""

from memfit.applying.apply_plan import Applied, applied, apply, remove_levers
from memfit.applying.fits import batch_shapes, check_made_for, check_plan_fits, made_for
from memfit.applying.lever import Lever, Site
from memfit.applying.registry import (
    REGISTRY,
    allowed_levers,
    check_levers,
    lever,
    lever_names,
    lever_sets,
    missing_torchao_hint,
    normalize_levers,
    register,
    site_of,
    unregister,
    usable_levers,
    with_levers,
)

__all__ = [
    "REGISTRY",
    "Applied",
    "Lever",
    "Site",
    "allowed_levers",
    "applied",
    "apply",
    "batch_shapes",
    "check_levers",
    "check_made_for",
    "check_plan_fits",
    "lever",
    "lever_names",
    "lever_sets",
    "made_for",
    "missing_torchao_hint",
    "normalize_levers",
    "register",
    "remove_levers",
    "site_of",
    "unregister",
    "usable_levers",
    "with_levers",
]
