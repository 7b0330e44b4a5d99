"""The models issue 36's benchmarks plan under pressure: ``build(name) -> Case``.

``gpt-6x384``: memfit's GPT, 6 x 384, batch 16 x 256, byte vocabulary (the issue's script);
``gpt-6x384-v8k``: the same with a vocabulary of 8192 (the time-model case at 70%);
``gpt-readme``: the README's GPT, 4 x 128, batch 8 x 128; ``gpt-12x256``: 12 x 256, batch
8 x 256; ``resnet``: a ResNet-18-style CNN (BasicBlocks 2-2-2-2, BatchNorm), batch 64 x 3 x
128 x 128 (the micro-batch case at 35%); ``resnet-small``: a quarter as wide, 32 x 3 x 128 x 128;
``hf-llama``: a Hugging Face ``LlamaForCausalLM`` from its config (4 x 256, vocabulary 8192,
batch 8 x 256; needs transformers). Every model is built seeded, with AdamW.

Used by ``bench_time_model.py``, ``bench_pytorch_planners.py`` and ``bench_planning_cost.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.models.gpt import GPT, GPTConfig, gpt_loss

__all__ = ["NAMES", "Case", "build"]


@dataclass
class Case:
    """One model, its batch, loss function, optimizer and the module class of its blocks."""

    name: str
    model: nn.Module
    batch: Any
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    optimizer: torch.optim.Optimizer
    block_class: type[nn.Module]


def _gpt(name: str, n_layer: int, n_embd: int, rows: int, seq: int, vocab: int = 256, heads: int = 0) -> Case:
    torch.manual_seed(0)
    heads = heads or max(1, n_embd // 64)
    cfg = GPTConfig(vocab_size=vocab, n_layer=n_layer, n_embd=n_embd, n_head=heads, block_size=seq)
    model = GPT(cfg)
    x = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(1))
    batch = (x[:, :-1].contiguous(), x[:, 1:].contiguous())
    block = type(model.blocks[0])
    return Case(name, model, batch, gpt_loss, torch.optim.AdamW(model.parameters()), block)


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convs with BatchNorm, a projected shortcut where it strides."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.short(x))


class ResNet18(nn.Module):
    """ResNet-18's layout (stem, four stages of two BasicBlocks, pooled head), 10 classes."""

    def __init__(self, classes: int = 10, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        widths, blocks, cin = (width, 2 * width, 4 * width, 8 * width), [], width
        for i, w in enumerate(widths):
            for j in range(2):
                blocks.append(BasicBlock(cin, w, 2 if j == 0 and i > 0 else 1))
                cin = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))
        return self.head(h.mean(dim=(2, 3)))


def _ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _resnet(name: str, rows: int, size: int, width: int = 64) -> Case:
    torch.manual_seed(0)
    model = ResNet18(width=width)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(rows, 3, size, size, generator=g), torch.randint(0, 10, (rows,), generator=g))
    return Case(name, model, batch, _ce, torch.optim.AdamW(model.parameters()), BasicBlock)


def _lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss  # type: ignore[no-any-return]


def _hf_llama(name: str) -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    x = torch.randint(0, cfg.vocab_size, (8, 256), generator=torch.Generator().manual_seed(1))
    return Case(name, model, x, _lm_loss, torch.optim.AdamW(model.parameters()), LlamaDecoderLayer)


_BUILDERS: dict[str, Callable[[], Case]] = {
    "gpt-6x384": lambda: _gpt("gpt-6x384", 6, 384, 16, 256),
    "gpt-6x384-v8k": lambda: _gpt("gpt-6x384-v8k", 6, 384, 16, 256, vocab=8192),
    "gpt-readme": lambda: _gpt("gpt-readme", 4, 128, 8, 128, heads=4),
    "gpt-12x256": lambda: _gpt("gpt-12x256", 12, 256, 8, 256),
    "resnet": lambda: _resnet("resnet", 64, 128),
    "resnet-small": lambda: _resnet("resnet-small", 32, 128, width=16),
    "hf-llama": lambda: _hf_llama("hf-llama"),
}
NAMES = list(_BUILDERS)


def build(name: str) -> Case:
    """The named case, built afresh (seeded: the same every call)."""
    if name not in _BUILDERS:
        raise SystemExit(f"unknown model {name!r}; one of {', '.join(NAMES)}")
    return _BUILDERS[name]()
