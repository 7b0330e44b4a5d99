"""The optimizer step fused into the backward: each parameter steps as soon as its gradient is complete.

``Tensor.register_post_accumulate_grad_hook`` runs when a parameter's gradient has been
accumulated for this backward; the hook steps that one parameter (the optimizer's own
``step`` with its param groups narrowed to the parameter, so its state, hyper-parameters,
learning-rate schedule and ``state_dict`` are the usual ones) and frees the gradient. So
the gradients are never all alive, and the step after the backward holds nothing.

- Micro-batches: the gradients of all but the last accumulate as usual; the step happens in
  the last micro-batch's backward (a parameter's gradient is then complete).
- Global-norm clipping needs every gradient's norm before any parameter steps: the last
  micro-batch's backward runs twice. The first (``retain_graph``) only adds up the norms and
  frees each gradient; the second steps with the clip coefficient computed exactly as
  ``torch.nn.utils.clip_grad_norm_`` does. It costs one more backward per step.
- fp16 loss scaling must see every gradient for overflow before stepping: refused
  (:mod:`memfit.applying.fused_step`).

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(4, 4)
    >>> opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    >>> fused = FusedStep(opt)
    >>> before = lin.weight.detach().clone()
    >>> norm = fused.backward(lin(torch.ones(2, 4)).sum(), clip_norm=None)
    >>> lin.weight.grad is None and not torch.equal(before, lin.weight)
    True
    >>> fused.remove()
"""

from __future__ import annotations

import weakref

import torch

from memfit.errors import CheckpointError, LeverRefused

__all__ = ["FusedStep", "fused_step_of"]

_FUSED: weakref.WeakKeyDictionary[torch.optim.Optimizer, FusedStep] = weakref.WeakKeyDictionary()


def fused_step_of(optimizer: torch.optim.Optimizer | None) -> FusedStep | None:
    """The :class:`FusedStep` installed for ``optimizer`` (None: it steps after the backward)."""
    return None if optimizer is None else _FUSED.get(optimizer)


class FusedStep:
    """Hooks on every trainable parameter of ``optimizer`` that step it inside the backward.

    Installing replaces an earlier one for the same optimizer; :meth:`remove` takes them off.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        old = _FUSED.get(optimizer)
        if old is not None:
            old.remove()
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self._group = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.mode = "off"
        """``off``: gradients accumulate; ``norm``: add the norm and free; ``step``: step and free."""
        self._norms: dict[int, torch.Tensor] = {}
        self._earlier: dict[int, torch.Tensor] = {}
        self._coef: torch.Tensor | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        _FUSED[optimizer] = self

    def remove(self) -> None:
        """Take the hooks off: the optimizer steps after the backward again."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if _FUSED.get(self.optimizer) is self:
            del _FUSED[self.optimizer]

    def _hook(self, p: torch.Tensor) -> None:
        if self.mode == "off" or p.grad is None:
            return
        if self.mode == "norm":
            earlier = self._earlier.get(id(p))
            whole = p.grad if earlier is None else earlier + p.grad
            self._norms[id(p)] = torch.linalg.vector_norm(whole.detach(), 2.0)
            p.grad = None
            return
        self.step_one(p)

    def step_one(self, p: torch.Tensor) -> None:
        """Step parameter ``p`` alone (its gradient clipped when clipping) and free its gradient."""
        if self._coef is not None and p.grad is not None:
            p.grad.mul_(self._coef.to(p.grad.device))
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        mine = self._group[id(p)]
        for i, g in enumerate(groups):
            g["params"] = [p] if i == mine else []
        try:
            self.optimizer.step()
        finally:
            for g, ps in zip(groups, saved, strict=True):
                g["params"] = ps
        p.grad = None

    def backward(self, loss: torch.Tensor, clip_norm: float | None) -> float | None:
        """The last micro-batch's backward with every parameter stepped in it; returns the
        gradient norm when clipping (before clipping, as ``clip_grad_norm_`` returns it)."""
        total: torch.Tensor | None = None
        self._coef = None
        try:
            if clip_norm is not None:
                # Earlier micro-batches' gradients wait aside (no copy) while the first
                # backward measures the norms of the sums; the second accumulates onto them
                # exactly as an unfused step would.
                self._earlier = {id(p): p.grad for p in self.params if p.grad is not None}
                for p in self.params:
                    p.grad = None
                self._norms = {}
                self.mode = "norm"
                loss.backward(retain_graph=True)
                for p in self.params:
                    if id(p) in self._earlier and id(p) not in self._norms:
                        self._norms[id(p)] = torch.linalg.vector_norm(self._earlier[id(p)].detach(), 2.0)
                norms = [self._norms[id(p)] for p in self.params if id(p) in self._norms]
                total = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.zeros(())
                self._coef = torch.clamp(clip_norm / (total + 1e-6), max=1.0)
                for p in self.params:
                    p.grad = self._earlier.get(id(p))
                self._earlier, self._norms = {}, {}
            self.mode = "step"
            try:
                loss.backward()
            except RuntimeError as exc:
                # memfit's CheckpointError carries PyTorch's own error as its cause
                # (see Note [a recompute per backward]).
                cause = exc.__cause__ if isinstance(exc, CheckpointError) else exc
                if "backward an extra time" not in str(cause):
                    raise
                raise LeverRefused(
                    "fused_step with clipping runs the backward twice (norms first, then the step), which "
                    "selective checkpointing allows once; use full checkpointing there, no clipping, or "
                    "no fused_step.",
                    "fused_step",
                ) from None
            self.mode = "off"
            # parameters whose gradient came only from earlier micro-batches step now
            for p in self.params:
                if p.grad is not None:
                    self.step_one(p)
        finally:
            self.mode = "off"
            self._coef = None
            self._earlier, self._norms = {}, {}
        return None if total is None else float(total)
