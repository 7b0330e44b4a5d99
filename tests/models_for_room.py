"""Models the room tests plan under a memory limit: ``build(name) -> (model, batch, loss_fn)``.

``gpt-6x384``: memfit's GPT, 6 layers x 384 wide, batch 16 x 256 (the issue's example; its
plain fp32 AdamW step peaks at 769,342,264 B). ``gpt-4x128``: the same at 4 x 128, batch
16 x 256, for the test suite (activations outweigh weights and optimizer state, as there).
``hf-llama``: a Hugging Face ``LlamaForCausalLM`` from its config (``use_cache`` on, as the
config makes it), trained through its own ``labels=`` loss. ``reads-values``: residual MLP
blocks behind a forward that reads a value, which fake tensors cannot run. ``gpt-wide-head``:
memfit's GPT with a 32,768-token vocabulary, 2 layers x 64, one row of 2,048 tokens: its loss
head's logits are most of the step (what long context does to a decoder).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.models.gpt import GPT, GPTConfig, gpt_loss

Built = tuple[nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor]]


def _gpt(n_layer: int, n_embd: int, rows: int, seq: int, vocab: int = 256) -> Built:
    torch.manual_seed(0)
    heads = max(1, n_embd // 64)
    model = GPT(GPTConfig(vocab_size=vocab, n_layer=n_layer, n_embd=n_embd, n_head=heads, block_size=seq))
    x = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(1))
    return model, (x[:, :-1].contiguous(), x[:, 1:].contiguous()), gpt_loss


def _lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss  # type: ignore[no-any-return]


def _hf_llama() -> Built:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(cfg)
    x = torch.randint(0, cfg.vocab_size, (8, 256), generator=torch.Generator().manual_seed(1))
    return model, x, _lm_loss


class ReadsValues(nn.Module):
    """Residual MLP blocks behind a forward that reads a computed tensor's value (fake tensors
    cannot: the batch's values may be known to them, the weights' are not)."""

    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            y = block(x)
            if i == 0 and float(y.abs().sum()) == 0.0:  # a data-dependent branch
                return x
            x = x + y
        return x


def _reads_values_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _reads_values(rows: int = 4096) -> Built:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return (
        ReadsValues(),
        (torch.randn(rows, 256, generator=g), torch.randn(rows, 256, generator=g)),
        _reads_values_loss,
    )


def build(name: str) -> Built:
    """The named model, its batch and loss function (seeded: the same every call)."""
    if name == "gpt-6x384":
        return _gpt(6, 384, 16, 256)
    if name == "gpt-4x128":
        return _gpt(4, 128, 16, 256)
    if name == "gpt-wide-head":
        return _gpt(2, 64, 1, 2048, vocab=32768)
    if name == "hf-llama":
        return _hf_llama()
    if name == "reads-values":
        return _reads_values()
    if name == "reads-values-small":
        return _reads_values(rows=1024)
    raise ValueError(f"unknown model {name!r}")
