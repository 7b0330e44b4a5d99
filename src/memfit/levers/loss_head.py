"""The loss head in chunks: a linear projection and cross-entropy that never make the whole logits.

A language model's last step turns hidden states ``[tokens, H]`` into logits
``[tokens, V]`` and takes their cross-entropy; at a 150k-token vocabulary the logits, their
fp32 upcast, the log-softmax and its gradient are the largest tensors of the step.
:func:`linear_cross_entropy` computes the same loss (and the same gradients) over chunks
of tokens: each chunk's logits are made in fp32, used and freed, so at most one chunk of
them exists at a time. This is the ``chunked_loss`` lever (:mod:`memfit.levers.head`
applies it to a model); the function is also for a user's own loss.

Trade-off: the head's bytes fall from a few times ``tokens x V x 4`` to one chunk's worth
plus the weight's fp32 gradient, for the same matmul work; small chunks run smaller,
less efficient matmuls (see Note [gradients in the forward pass]).

Example:
    >>> import torch, torch.nn.functional as F
    >>> torch.manual_seed(0)
    <torch._C.Generator object at ...>
    >>> h = torch.randn(6, 8, requires_grad=True)
    >>> w = torch.randn(50, 8, requires_grad=True)
    >>> y = torch.tensor([1, 2, -100, 4, 5, 6])
    >>> loss = linear_cross_entropy(h, w, y, chunk_tokens=4)
    >>> torch.allclose(loss, F.cross_entropy(h @ w.T, y))
    True
    >>> loss.backward()
    >>> h.grad.shape, w.grad.shape
    (torch.Size([6, 8]), torch.Size([50, 8]))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import ConfigError

__all__ = [
    "CHUNK_ELEMENTS",
    "IGNORE_INDEX",
    "default_chunk_tokens",
    "head_loss",
    "linear_cross_entropy",
    "plain_cross_entropy",
]

#: The label that marks a token the loss skips (PyTorch's and Hugging Face's convention).
IGNORE_INDEX = -100
#: Logit elements in one chunk by default: 2**23 (32 MiB in fp32).
CHUNK_ELEMENTS = 2**23

Reduction = Literal["mean", "sum"]


def default_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk so that one chunk's fp32 logits hold :data:`CHUNK_ELEMENTS` values.

    Example:
        >>> default_chunk_tokens(32000), default_chunk_tokens(151936)
        (262, 55)
    """
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


@dataclass(frozen=True)
class _Options:
    ignore_index: int
    scale: float | None
    softcap: float | None
    reduction: Reduction
    chunk: int
    dtype: torch.dtype
    """The dtype the matmuls run in (autocast's, or the weight's)."""
    grad_mode: bool
    """Grad mode where the loss was called (inside ``forward`` it is always off)."""


# Note [gradients in the forward pass]
# The loss is the last thing of the step and its gradient wrt the logits is known in
# closed form (softmax minus one-hot, over the count of non-ignored tokens), so each chunk's
# logits are made once: the forward computes the loss AND the gradients wrt hidden, weight
# and bias chunk by chunk, keeps them, and the backward only multiplies them by the
# incoming gradient (1, or 1/micro-batches). The alternative, recomputing each chunk's
# logits in the backward, keeps nothing but costs a fourth matmul (1.33x the head's work);
# this one does the same three matmuls as the plain head and keeps the weight's fp32
# gradient (V x H) and the hidden states' gradient (tokens x H) from the forward to the
# backward: the plain head makes those in its backward anyway, a moment later. Under
# autocast the matmuls run in its dtype as the plain head's do; logits, softmax and the
# weight-gradient sum are fp32. The backward may run once (a second, retained backward is
# refused), and a loss computed with no input requiring grad keeps nothing.


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        opts: _Options,
    ) -> torch.Tensor:
        need = tuple(n and opts.grad_mode for n in ctx.needs_input_grad[:3])
        with torch.autocast(hidden.device.type, enabled=False):
            loss, grads = _loss_and_grads(hidden, weight, bias, targets, opts, need)
        ctx.grads = grads
        ctx.shapes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(
                "the chunked loss head's gradients were used by a first backward; it cannot run "
                "backward twice (retain_graph): compute the loss again."
            )
        ctx.grads = None  # freed as they go to the parameters (Note [gradients in the forward pass])
        out: list[torch.Tensor | None] = []
        for g, dtype in zip(grads, ctx.shapes, strict=True):
            if g is None or dtype is None:
                out.append(None)
                continue
            g = g.mul_(grad_loss.to(g.dtype))
            out.append(g if g.dtype == dtype else g.to(dtype))
        return out[0], out[1], out[2], None, None


def _loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    opts: _Options,
    need: tuple[bool, ...],
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """The loss and (where ``need``) the gradients of hidden, weight and bias, chunk by chunk."""
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    w = weight.to(opts.dtype)
    b = None if bias is None else bias.to(opts.dtype)
    count = (t != opts.ignore_index).sum()
    denom = count.clamp(min=1).to(torch.float32) if opts.reduction == "mean" else None
    grad_h = torch.empty_like(h2) if need[0] else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need[1] else None
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need[2] else None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grads = (grad_h, grad_w, grad_b)
    for start in range(0, h2.shape[0], opts.chunk):
        # one call per chunk: its logits are freed when the call returns, before the next chunk's
        _chunk_step(h2, t, w, b, start, opts, total, denom, grads)
    loss = total / count.to(torch.float32) if opts.reduction == "mean" else total
    return loss, (None if grad_h is None else grad_h.view(hidden.shape), grad_w, grad_b)


def _chunk_step(
    h2: torch.Tensor,
    t: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    start: int,
    opts: _Options,
    total: torch.Tensor,
    denom: torch.Tensor | None,
    grads: tuple[torch.Tensor | None, ...],
) -> None:
    """One chunk: its loss sum into ``total``, its gradients into ``grads`` (hidden, weight, bias)."""
    grad_h, grad_w, grad_b = grads
    hc = h2[start : start + opts.chunk].to(opts.dtype)
    tc = t[start : start + opts.chunk]
    need = any(g is not None for g in grads)
    e, sums, dcap, valid = _chunk_loss(hc, w, b, tc, opts, total, need)
    if not need:
        return
    p = _chunk_grad(e, sums, dcap, tc, valid, denom, opts)
    pc = p.to(opts.dtype)
    if grad_h is not None:
        grad_h[start : start + opts.chunk] = pc @ w
    if grad_w is not None:
        _add_weight_grad(grad_w, pc, hc)
    if grad_b is not None:
        grad_b += p.sum(0)


def _add_weight_grad(grad_w: torch.Tensor, pc: torch.Tensor, hc: torch.Tensor) -> None:
    """``grad_w += pc.T @ hc`` with ``grad_w`` fp32 and no vocabulary x hidden temporary.

    In fp32 it is one in-place ``addmm_``. In bf16/fp16 (no mixed-dtype ``addmm`` on every
    device) the product is made for slices of the vocabulary, each about one chunk's logits
    in size: a whole V x H product in bf16 would be as large as half the weight gradient
    itself (1 GB for Llama 3's 128k x 4096 head), made once per chunk.
    """
    if pc.dtype == torch.float32:
        grad_w.addmm_(pc.T, hc.to(torch.float32))
        return
    rows = max(1, CHUNK_ELEMENTS // max(1, grad_w.shape[1]))
    for s in range(0, grad_w.shape[0], rows):
        grad_w[s : s + rows] += pc[:, s : s + rows].T @ hc


def _chunk_loss(
    hc: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    tc: torch.Tensor,
    opts: _Options,
    total: torch.Tensor,
    grads: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Add one chunk's loss sum to ``total``.

    Returns ``exp(logits - max)`` (made in place of the fp32 logits: one chunk-sized tensor),
    its row sums, the soft-cap's derivative (or None) and the mask of non-ignored tokens.
    """
    z = F.linear(hc, w, b).float()
    if opts.scale is not None:
        z.mul_(opts.scale)
    dcap = None
    if opts.softcap is not None:
        z.div_(opts.softcap).tanh_()
        # d(cap * tanh(x / cap)) / dx = 1 - tanh^2, kept before z is overwritten
        dcap = 1.0 - z.square() if grads else None
        z.mul_(opts.softcap)
    valid = tc != opts.ignore_index
    safe = torch.where(valid, tc, torch.zeros_like(tc))
    picked = z.gather(1, safe[:, None]).squeeze(1)
    top = z.amax(dim=1)
    z.sub_(top[:, None]).exp_()
    sums = z.sum(dim=1)
    total += ((sums.log() + top - picked) * valid).sum()
    return z, sums, dcap, valid


def _chunk_grad(
    e: torch.Tensor,
    sums: torch.Tensor,
    dcap: torch.Tensor | None,
    tc: torch.Tensor,
    valid: torch.Tensor,
    denom: torch.Tensor | None,
    opts: _Options,
) -> torch.Tensor:
    """One chunk's gradient wrt its raw logits, made in place of ``e`` (softmax minus one-hot)."""
    p = e.div_(sums[:, None])
    rows = torch.arange(p.shape[0], device=p.device)
    safe = torch.where(valid, tc, torch.zeros_like(tc))
    p[rows, safe] -= 1.0
    weight = valid.to(torch.float32)
    if denom is not None:
        weight = weight / denom
    p.mul_(weight[:, None])
    if dcap is not None:
        p.mul_(dcap)
    if opts.scale is not None:
        p.mul_(opts.scale)
    return p


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_scale: float | None = None,
    softcap: float | None = None,
    reduction: Reduction = "mean",
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``targets``, a chunk of tokens at a time.

    Equal to ``F.cross_entropy((hidden @ weight.T + bias).float(), targets,
    ignore_index=ignore_index, reduction=reduction)`` (with the logits first multiplied by
    ``logit_scale``, then soft-capped to ``softcap * tanh(logits / softcap)``), loss and
    gradients, without the whole logits tensor: see Note [gradients in the forward pass].

    Args:
        hidden: ``[..., H]`` hidden states (the head's input).
        weight: ``[V, H]`` head weight (tied to the embedding or not).
        targets: integer labels of ``hidden``'s leading shape; ``ignore_index`` skips a token.
        bias: ``[V]`` head bias, or None.
        ignore_index: the label of skipped tokens (-100).
        logit_scale: multiply the logits by this (Cohere's ``logit_scale``; Granite's
            ``1 / logits_scaling``), or None.
        softcap: soft-cap the (scaled) logits at this (Gemma 2's
            ``final_logit_softcapping``), or None.
        reduction: ``mean`` over the non-ignored tokens (NaN when there are none, as
            PyTorch's), or ``sum``.
        chunk_tokens: tokens per chunk (default :func:`default_chunk_tokens`).

    Returns:
        The scalar fp32 loss.

    Raises:
        ConfigError: shapes that do not match, or a chunk size below 1.
    """
    _check(hidden, weight, targets, bias, chunk_tokens, reduction)
    dev = hidden.device.type
    autocast = torch.is_autocast_enabled(dev)
    dtype = torch.get_autocast_dtype(dev) if autocast else weight.dtype
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    opts = _Options(ignore_index, logit_scale, softcap, reduction, chunk, dtype, torch.is_grad_enabled())
    loss: torch.Tensor = _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, opts)
    return loss


def _check(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_tokens: int | None,
    reduction: str,
) -> None:
    if weight.ndim != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ConfigError(
            f"the head weight must be [vocab, hidden] with hidden {hidden.shape[-1]}; "
            f"it is {list(weight.shape)}."
        )
    if targets.shape != hidden.shape[:-1]:
        raise ConfigError(
            f"targets {list(targets.shape)} must have the hidden states' leading shape "
            f"{list(hidden.shape[:-1])}."
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ConfigError(f"the head bias must be [{weight.shape[0]}]; it is {list(bias.shape)}.")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens must be at least 1, got {chunk_tokens}.")
    if reduction not in ("mean", "sum"):
        raise ConfigError(f"reduction must be 'mean' or 'sum', got {reduction!r}.")


def plain_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
    logit_scale: float | None = None,
    softcap: float | None = None,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """The same loss with the whole logits, as Hugging Face's models compute it: the reference.

    The logits are made in the head's dtype (autocast's), scaled and soft-capped there,
    upcast to fp32 and passed to ``F.cross_entropy``, the head's-dtype logits alive until the
    loss is made (as a model's forward keeps them for its output).
    """
    logits = F.linear(hidden, weight, bias)
    if logit_scale is not None:
        logits = logits * logit_scale
    if softcap is not None:
        logits = logits / softcap
        logits = torch.tanh(logits)
        logits = logits * softcap
    # the head's-dtype logits stay alive beside their fp32 copy, as in the models' forward
    # (which keeps them for its output): the reference's bytes are the models' bytes
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=ignore_index, reduction=reduction)


def head_loss(
    hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, chunk_tokens: int | None
) -> torch.Tensor:
    """Next-token cross-entropy of memfit's built-in models: the whole logits (``chunk_tokens``
    None: the plain head, upcast to fp32) or :func:`linear_cross_entropy` in chunks."""
    if chunk_tokens is None:
        logits = head(hidden)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
    return linear_cross_entropy(hidden, head.weight, targets, head.bias, chunk_tokens=chunk_tokens)
