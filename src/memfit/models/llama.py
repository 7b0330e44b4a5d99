"""A LLaMA-style decoder (RMSNorm, rotary positions, SwiGLU MLP, untied head) for estimates.

memfit's estimator needs a realistic large model to estimate without downloading weights:
``llama(preset="7b")`` builds the 32-layer, 4096-wide, 32-head, 11008-hidden configuration
(6.74 B parameters with the 32000-token vocabulary). Build it under fake tensors
(:func:`memfit.estimate` does) unless you have the memory; ``preset="tiny"`` runs anywhere.

From the command line the factory is ``import:memfit.models.llama:llama``, e.g.
``memfit estimate --set model.name=import:memfit.models.llama:llama --set model.kwargs.preset=7b
--set train.batch_size=1``.

Example:
    >>> import torch
    >>> spec = llama(preset="tiny")
    >>> x, y = spec.random_batch(2, seed=0)
    >>> spec.model(x).shape
    torch.Size([2, 16, 256])
    >>> spec.loss_fn(spec.model, (x, y)).ndim
    0
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import ConfigError
from memfit.levers.loss_head import head_loss
from memfit.models.gpt import gpt_loss
from memfit.models.spec import ModelSpec

__all__ = ["PRESETS", "Llama", "LlamaConfig", "llama"]


@dataclass(kw_only=True)
class LlamaConfig:
    """Sizes of the LLaMA-style model."""

    vocab_size: int = 256
    """Vocabulary size (32000 in LLaMA; 256 for byte-level text)."""
    n_layer: int = 2
    """Number of decoder blocks."""
    n_embd: int = 32
    """Width of the residual stream."""
    n_head: int = 2
    """Attention heads; must divide n_embd into an even head size."""
    n_kv_head: int = 0
    """Key/value heads (grouped-query attention, as in Llama 3); 0 means n_head (one per query head)."""
    hidden: int = 0
    """SwiGLU hidden width; 0 means LLaMA's rule, 2/3 * 4 * n_embd rounded up to 256."""
    block_size: int = 16
    """Longest sequence (context length)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_embd", "n_head", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.kwargs.{name} must be a positive integer, got {value!r}.")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ConfigError(
                f"model.kwargs.n_embd ({self.n_embd}) must split into n_head ({self.n_head}) "
                "heads of even size."
            )
        if self.hidden == 0:
            self.hidden = 256 * -(-(8 * self.n_embd // 3) // 256)
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise ConfigError(
                f"model.kwargs.n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head}); "
                "use 0 for one key/value head per query head."
            )


#: Named sizes; ``7b`` is LLaMA-7B's shape, ``8b`` Llama-3-8B's (128,256-token vocabulary,
#: 8 key/value heads, 8.03 B parameters), ``1.3b`` a 24-layer, 2048-wide one (1.36 B parameters).
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {},
    "1.3b": {
        "vocab_size": 32000,
        "n_layer": 24,
        "n_embd": 2048,
        "n_head": 16,
        "block_size": 4096,
    },
    "7b": {
        "vocab_size": 32000,
        "n_layer": 32,
        "n_embd": 4096,
        "n_head": 32,
        "hidden": 11008,
        "block_size": 4096,
    },
    "8b": {
        "vocab_size": 128256,
        "n_layer": 32,
        "n_embd": 4096,
        "n_head": 32,
        "n_kv_head": 8,
        "hidden": 14336,
        "block_size": 8192,
    },
}


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with rotary position embeddings and no biases."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        kv = cfg.n_embd // cfg.n_head * cfg.n_kv_head
        self.wq = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.wk = nn.Linear(cfg.n_embd, kv, bias=False)
        self.wv = nn.Linear(cfg.n_embd, kv, bias=False)
        self.wo = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        d = c // self.n_head
        q = self.wq(x).view(b, t, self.n_head, d).transpose(1, 2)
        k, v = (w(x).view(b, t, self.n_kv_head, d).transpose(1, 2) for w in (self.wk, self.wv))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.n_kv_head != self.n_head:  # grouped-query attention: each kv head serves a group
            k, v = (z.repeat_interleave(self.n_head // self.n_kv_head, dim=1) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, c))


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.n_embd, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.n_embd, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """A LLaMA-style language model; ``forward(idx)`` returns logits, ``forward(idx, targets)``
    the next-token loss (in chunks of tokens under the ``chunked_loss`` lever)."""

    #: Tokens per chunk of the loss head (:mod:`memfit.levers.head`); None: the whole logits.
    loss_chunk_tokens: int | None = None

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        half = cfg.n_embd // cfg.n_head // 2
        freqs = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(cfg.block_size, dtype=torch.float32), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(
                f"sequence length {t} is longer than the model's block_size {self.config.block_size}; "
                "shorten the batch or raise model.kwargs.block_size."
            )
        x = self.tok_emb(idx)
        cos, sin = self.get_buffer("cos")[:t], self.get_buffer("sin")[:t]
        for block in self.blocks:
            x = block(x, cos, sin)
        if targets is not None:
            return head_loss(self.norm(x), self.head, targets, self.loss_chunk_tokens)
        return self.head(self.norm(x))


def llama(preset: str = "tiny", **overrides: Any) -> ModelSpec:
    """Build a LLaMA-style model from a preset (``tiny``, ``1.3b``, ``7b``, ``8b``) and field overrides.

    Args:
        preset: a key of :data:`PRESETS`.
        overrides: :class:`LlamaConfig` fields, e.g. ``n_layer=4``.

    Returns:
        A :class:`ModelSpec` with next-token cross-entropy and random-token batches.
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown llama preset {preset!r}; use one of {', '.join(PRESETS)}.")
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(f"llama has no setting(s) {unknown}; valid: {', '.join(sorted(fields))}.")
    cfg = LlamaConfig(**{**PRESETS[preset], **overrides})
    return ModelSpec(model=Llama(cfg), loss_fn=gpt_loss, seq_len=cfg.block_size, vocab_size=cfg.vocab_size)
