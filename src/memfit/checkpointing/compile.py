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
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memfit import progress

__all__ = ["compile_in_place", "compiling_step", "eager", "is_compiled"]

#: Compiled models whose first training step has run (it compiles: see compiling_step).
_STEPPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
#: How many eager() contexts are open: steps in them run the model eagerly, nothing compiles.
_EAGER = [0]


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
    _EAGER[0] += 1
    try:
        with set_stance("force_eager") if set_stance is not None else contextlib.nullcontext():
            yield
    finally:
        _EAGER[0] -= 1


def compiling_step(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """While the first training step of a compiled ``model`` runs, a progress line (repeated
    every 10 s) saying that it compiles and is slow only the first time; otherwise nothing.

    torch.compile compiles the forward and the backward when the step first runs them: tens of
    seconds on a CPU, with nothing else to say (``memfit train`` sat silent for 51 s).

    Example:
        >>> compiling_step(nn.Linear(2, 2))  # not compiled: nothing to say
        <contextlib.nullcontext object at 0x...>
    """
    if not is_compiled(model) or model in _STEPPED or _EAGER[0] or torch._dynamo.config.disable:
        return contextlib.nullcontext()
    _STEPPED.add(model)
    return progress.waiting(
        f"compiling {type(model).__name__}'s forward and backward with torch.compile (slow only on the "
        "first step)"
    )
