"""Models trained under ``torch.compile``: plans are made eagerly, the steps may run compiled.

memfit measures a model eagerly: profiling and planning run each block as written (the
numbers a plan rests on are the eager step's, which MemTracker sees whole), and then the
plan is applied and the model compiled. Everything memfit installs for checkpointing
compiles (:func:`memfit.checkpointing.policy.compiled_contexts`), so the plan holds compiled: the
same gradients, BatchNorm statistics updated once, the same ``state_dict`` keys.

:func:`compile_in_place` compiles with ``nn.Module.compile`` (the module itself, not an
``OptimizedModule`` wrapper, so ``state_dict`` keys keep no ``_orig_mod.`` prefix);
:func:`eager` is the context every measurement runs in.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> is_compiled(model)
    False
    >>> compile_in_place(model) is model
    True
    >>> is_compiled(model), list(model.state_dict())[0]
    (True, '0.weight')
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["compile_in_place", "eager", "is_compiled"]


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` runs compiled: ``model.compile()`` was called, or it is the wrapper
    ``torch.compile(model)`` returns."""
    if type(model).__name__ == "OptimizedModule":
        return True
    # nn.Module.compile() stores the compiled call here; nothing public says so.
    return getattr(model, "_compiled_call_impl", None) is not None


def compile_in_place(model: nn.Module, **options: Any) -> nn.Module:
    """Compile ``model`` itself (``model.compile(**options)``) unless it already runs compiled.

    Returns:
        ``model`` (the same object, so optimizers, plans and state_dicts stay valid).
    """
    if not is_compiled(model):
        model.compile(**options)
    return model


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run compiled models eagerly in the body (measuring, planning)."""
    # Note [measuring compiled models eagerly]
    # Two reasons. A plan is made from the eager step (what MemTracker can see), and dynamo
    # must not be entered while a measurement's dispatch modes are active: it skips the frame
    # and, measured on torch 2.13, does not compile it again after the model is checkpointed,
    # so the compiled model silently kept its un-checkpointed graph.
    # torch.compiler.set_stance exists from torch 2.6; before it, there is nothing to do.
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        yield
        return
    with set_stance("force_eager"):
        yield
