"""A small GPT with a byte-level vocabulary: memfit's built-in model for demos and tests.

It is a plain pre-norm transformer (token and position embeddings, ``n_layer`` blocks of
causal self-attention and an MLP, a final LayerNorm and a tied output head), written so
that :func:`memfit.find_blocks` finds ``blocks.0 ... blocks.{n_layer-1}``.

Example:
    >>> import torch
    >>> model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> x = torch.randint(0, 256, (3, 16))
    >>> model(x).shape
    torch.Size([3, 16, 256])
    >>> gpt_loss(model, (x, x)).ndim
    0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from memfit.devices import unwrap
from memfit.levers.loss_head import head_loss

__all__ = ["GPT", "GPTConfig", "gpt_loss"]


@dataclass(kw_only=True)
class GPTConfig:
    """Sizes of the built-in GPT."""

    vocab_size: int = 256
    """Vocabulary size; 256 for byte-level text."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_embd: int = 128
    """Width of the residual stream."""
    n_head: int = 4
    """Attention heads; must divide n_embd."""
    block_size: int = 128
    """Longest sequence (context length)."""
    dropout: float = 0.0
    """Dropout probability on attention weights and residual branches."""
    bias: bool = True
    """Use biases in Linear and LayerNorm layers."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of n_embd."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_embd", "n_head", "block_size", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}.")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout!r}.")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention using PyTorch's fused SDPA kernel."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Two Linear layers with a GELU between them."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """A pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A byte-level GPT language model; ``forward(idx)`` returns logits, ``forward(idx, targets)``
    the next-token loss (in chunks of tokens under the ``chunked_loss`` lever)."""

    #: Tokens per chunk of the loss head (:mod:`memfit.levers.head`); None: the whole logits.
    loss_chunk_tokens: int | None = None

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = cfg or GPTConfig()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(
                f"sequence length {t} is longer than the model's block_size "
                f"{self.config.block_size}; shorten the batch or raise model.block_size."
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        if targets is not None:
            return head_loss(self.ln_f(x), self.head, targets, self.loss_chunk_tokens)
        return self.head(self.ln_f(x))


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-byte cross-entropy: ``batch = (inputs, targets)``, both ``(B, T)`` integers.

    Under the ``chunked_loss`` lever memfit's GPT and LLaMA compute it in their forward
    (``model(x, targets=y)``, in chunks of tokens); otherwise the logits are taken here.
    """
    x, y = batch
    # Note [the built-in loss outside the forward]
    # Without the chunked_loss lever the loss is taken here, outside the model's forward, as
    # before the lever existed: under FSDP2 a loss computed inside the root module's forward
    # moves the root's backward hooks before the cross-entropy's backward, and the per-rank
    # peak grew 3.5% over sharding's prediction (tests/integrations/test_distributed.py).
    if getattr(unwrap(model), "loss_chunk_tokens", None) is not None:
        return model(x, targets=y)
    logits = model(x)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
