"""The planner's test models: one model, batch and loss per shape of network it must handle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from conftest import (
    DropoutMLP,
    ResNetish,
    SmallCNN,
    TinyUNet,
    VariedMLP,
    cnn_loss,
    image_batch,
    image_regression_batch,
    mse_loss,
    tiny_gpt,
    token_batch,
    vector_batch,
)
from torch import nn

from memfit.measuring.profile import profile
from memfit.models.gpt import gpt_loss
from memfit.records import Profile

Case = tuple[Callable[[], nn.Module], Any, Callable[..., torch.Tensor]]
CASES: dict[str, Case] = {
    "gpt": (lambda: tiny_gpt(n_layer=3), token_batch(8, 16), gpt_loss),
    "cnn_batchnorm": (lambda: SmallCNN(ch=8, n_blocks=3), image_batch(8, 12), cnn_loss),
    "resnet_batchnorm": (lambda: ResNetish(width=8, layers=(2, 2)), image_batch(8, 16), cnn_loss),
    "uneven_blocks": (lambda: VariedMLP(), vector_batch(256, 32), mse_loss),
    "unet_skips": (lambda: TinyUNet(), image_regression_batch(4, 16), mse_loss),
    "dropout": (lambda: DropoutMLP(width=32, n_blocks=4), vector_batch(128, 32), mse_loss),
}


class Setup:
    """One model, its optimizer, batch, loss and fp32 profile (profiled once per module)."""

    def __init__(self, name: str) -> None:
        make, batch, loss_fn = CASES[name]
        torch.manual_seed(0)
        self.name = name
        self.model = make()
        self.batch = batch
        self.loss_fn = loss_fn
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.profile: Profile = profile(self.model, batch, loss_fn, self.opt, "fp32", repeats=1)
