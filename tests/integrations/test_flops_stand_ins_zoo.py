"""Third-party models' FLOPs counted with identical blocks run once equal every block run.

As ``tests/test_flops_stand_ins.py``, on a Hugging Face decoder built from its config
(trained through its own ``labels=`` loss, cache on) and torchvision's Vision Transformer,
each with four identical layers (two of them stand in for the others).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_flops_stand_ins import flops_agree


def test_hf_llama_flops_with_identical_layers_run_once_equal_every_layer_run() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).train()
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    stood = flops_agree(model, x, lambda m, b: m(input_ids=b, labels=b).loss)
    assert stood == {"model.layers.1": "model.layers.0", "model.layers.2": "model.layers.0"}


def test_torchvision_vit_flops_with_identical_layers_run_once_equal_every_layer_run() -> None:
    tvm = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    model = tvm.VisionTransformer(
        image_size=32, patch_size=8, num_layers=4, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
    ).train()
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(1))
    stood = flops_agree(model, (x, y), lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    assert len(stood) == 2
