"""The zoo's vision models: torchvision and timm, random weights, small widths and depths.

Every setting not given here is the library's default: in-place activations, BatchNorm,
stochastic depth, dropout heads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from zoo import Batch, Entry, generator, layers

CLASSES = 10


def _ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _images(size: int) -> Callable[[int], Batch]:
    def make(n: int) -> Batch:
        g = generator()
        return torch.randn(n, 3, size, size, generator=g), torch.randint(0, CLASSES, (n,), generator=g)

    return make


def _tv(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        torch.manual_seed(0)
        return torchvision.models.get_model(name, weights=None, num_classes=CLASSES, **kwargs).train()

    return build


def _timm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        torch.manual_seed(0)
        return timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs).train()

    return build


def _maxxvit(cfg: str, **fields: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from dataclasses import replace

        from timm.models import maxxvit

        base = maxxvit.model_cfgs[cfg]
        small = replace(base, transformer_cfg=replace(base.transformer_cfg, dim_head=8), **fields)
        torch.manual_seed(0)
        return maxxvit.MaxxVit(small, img_size=32, num_classes=CLASSES).train()

    return build


def _tv_small(name: str) -> Callable[[], nn.Module]:
    """torchvision architectures from their public classes, at a small width and depth."""

    def build() -> nn.Module:
        import torchvision.models as tvm
        from torchvision.models.convnext import CNBlockConfig
        from torchvision.models.efficientnet import MBConvConfig
        from torchvision.models.regnet import BlockParams

        torch.manual_seed(0)
        small: dict[str, Callable[[], nn.Module]] = {
            "efficientnet": lambda: tvm.EfficientNet(
                [
                    MBConvConfig(1, 3, 1, 16, 8, 1),
                    MBConvConfig(6, 3, 2, 8, 16, 2),
                    MBConvConfig(6, 5, 2, 16, 24, 2),
                ],
                dropout=0.2,
                num_classes=CLASSES,
            ),
            "densenet": lambda: tvm.DenseNet(
                growth_rate=8, block_config=(2, 3, 2), num_init_features=16, bn_size=2, num_classes=CLASSES
            ),
            "swin": lambda: tvm.SwinTransformer(
                patch_size=[2, 2],
                embed_dim=16,
                depths=[2, 2],
                num_heads=[2, 4],
                window_size=[4, 4],
                num_classes=CLASSES,
            ),
            "convnext": lambda: tvm.ConvNeXt(
                [CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 2)], num_classes=CLASSES
            ),
            "regnet_y": lambda: tvm.RegNet(
                BlockParams.from_init_params(depth=5, w_0=16, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25),
                stem_width=16,
                num_classes=CLASSES,
            ),
            "vit": lambda: tvm.VisionTransformer(
                image_size=32,
                patch_size=8,
                num_layers=2,
                num_heads=2,
                hidden_dim=32,
                mlp_dim=64,
                num_classes=CLASSES,
            ),
            "maxvit": lambda: tvm.MaxVit(
                input_size=(32, 32),
                stem_channels=8,
                partition_size=2,
                block_channels=[16, 32],
                block_layers=[2, 2],
                head_dim=8,
                stochastic_depth_prob=0.2,
                num_classes=CLASSES,
            ),
        }
        return small[name]().train()

    return build


def _timm_small(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from timm.models import levit, metaformer, regnet

        torch.manual_seed(0)
        small: dict[str, Callable[[], nn.Module]] = {
            "levit": lambda: levit.Levit(
                img_size=32,
                embed_dim=(16, 24, 32),
                key_dim=8,
                depth=(2, 3, 2),
                num_heads=(2, 3, 4),
                stem_type="s16",
                num_classes=CLASSES,
            ),
            "regnet": lambda: regnet.RegNet(
                regnet.RegNetCfg(depth=7, w0=16, wa=8.0, wm=1.5, group_size=8, stem_width=8),
                num_classes=CLASSES,
            ),
            "poolformer": lambda: metaformer.MetaFormer(
                depths=(2, 2, 2, 2),
                dims=(16, 24, 32, 48),
                downsample_norm=None,
                mlp_act=nn.GELU,
                mlp_bias=True,
                norm_layers=metaformer.GroupNorm1,
                layer_scale_init_values=1e-5,
                res_scale_init_values=None,
                use_mlp_head=False,
                num_classes=CLASSES,
            ),
        }
        return small[name]().train()

    return build


def _stages(prefix: str, depths: tuple[int, ...], inner: str = "blocks") -> list[str]:
    """``prefix.<stage>.<inner>.<block>`` (or ``prefix.<stage>.<block>``) for stages of these depths."""
    return [f"{prefix}.{s}.{inner}.{i}" if inner else f"{prefix}.{s}.{i}"
            for s, d in enumerate(depths) for i in range(d)]  # fmt: skip


VISION: list[Entry] = [
    Entry("torchvision/shufflenet_v2", _tv("shufflenet_v2_x0_5"), _ce, _images(64),
          [f"stage{s}.{i}" for s, d in ((2, 4), (3, 8), (4, 4)) for i in range(d)],
          covers="CNN, BatchNorm, in-place ReLU, channel shuffle"),
    Entry("torchvision/efficientnet", _tv_small("efficientnet"), _ce, _images(32),
          ["features.1.0", "features.2.0", "features.2.1", "features.3.0", "features.3.1"],
          covers="MBConv, squeeze-excite, in-place SiLU, stochastic depth, Dropout(inplace) head"),
    Entry("torchvision/densenet", _tv_small("densenet"), _ce, _images(32),
          [f"features.denseblock{b}.denselayer{i}" for b, d in ((1, 2), (2, 3), (3, 2))
           for i in range(1, d + 1)],
          covers="DenseNet: blocks in nn.ModuleDict, a growing list of features"),
    Entry("torchvision/swin", _tv_small("swin"), _ce, _images(32),
          ["features.1.0", "features.1.1", "features.3.0", "features.3.1"], covers="Swin: shifted windows"),
    Entry("torchvision/convnext", _tv_small("convnext"), _ce, _images(32),
          ["features.1.0", "features.1.1", "features.3.0", "features.3.1"], covers="ConvNeXt, layer scale"),
    Entry("torchvision/mobilenet_v3_small", _tv("mobilenet_v3_small", width_mult=0.5), _ce, _images(64),
          [f"features.{i}" for i in range(1, 12)], covers="hard-swish, squeeze-excite, in-place activations"),
    Entry("torchvision/regnet_y", _tv_small("regnet_y"), _ce, _images(32),
          ["trunk_output.block1.block1-0"] + [f"trunk_output.block2.block2-{i}" for i in range(3)]
          + ["trunk_output.block3.block3-0"],
          covers="RegNet: stages of different widths, squeeze-excite"),
    Entry("torchvision/vit", _tv_small("vit"), _ce, _images(32),
          [f"encoder.layers.encoder_layer_{i}" for i in range(2)], covers="ViT"),
    Entry("torchvision/maxvit", _tv_small("maxvit"), _ce, _images(32),
          ["blocks.0.layers.0", "blocks.0.layers.1", "blocks.1.layers.0", "blocks.1.layers.1"],
          covers="MaxViT: conv stem of two layers, MBConv + window + grid attention"),
    Entry("timm/resnet18d", _timm("resnet18d", channels=(16, 32, 64, 128), stem_width=8), _ce, _images(64),
          [f"layer{s}.{i}" for s in range(1, 5) for i in range(2)], large=32,
          covers="CNN, BatchNorm, in-place ReLU, deep stem, average-pool shortcut"),
    Entry("timm/efficientnet_b0", _timm("efficientnet_b0"), _ce, _images(64),
          _stages("blocks", (1, 2, 2, 3, 3, 4, 1), ""), large=8,
          covers="first block of its own class, BatchNormAct, in-place SiLU after convs"),
    Entry("timm/coatnet", _maxxvit("coatnet_nano_rw", embed_dim=(16, 24, 32, 48), depths=(2, 2, 2, 2),
                                   stem_width=(8, 16)), _ce, _images(32), _stages("stages", (2, 2, 2, 2)),
          covers="CoAtNet: conv and transformer stages, in-place ops on convolution outputs"),
    Entry("timm/maxvit", _maxxvit("maxvit_nano_rw", embed_dim=(16, 24, 32, 48), depths=(1, 2, 2, 1),
                                  stem_width=(8, 16)), _ce, _images(32), _stages("stages", (1, 2, 2, 1)),
          covers="MaxViT: MBConv + block and grid attention as attributes"),
    Entry("timm/convnext", _timm("convnext_atto", dims=(16, 24, 32, 48), depths=(2, 2, 2, 2)), _ce,
          _images(32), _stages("stages", (2, 2, 2, 2)), covers="ConvNeXt stages with down-sampling"),
    Entry("timm/regnet", _timm_small("regnet"), _ce, _images(64),
          ["s1.b1", "s2.b1", "s3.b1", "s3.b2", "s4.b1", "s4.b2", "s4.b3"],
          covers="RegNet: blocks as plain attributes"),
    Entry("timm/levit", _timm_small("levit"), _ce, _images(32), _stages("stages", (2, 3, 2)),
          covers="LeViT: attention down-sampling between stages"),
    Entry("timm/poolformer", _timm_small("poolformer"), _ce, _images(32),
          _stages("stages", (2, 2, 2, 2)),
          covers="MetaFormer / PoolFormer, GroupNorm"),
    Entry("timm/swin", _timm("swin_tiny_patch4_window7_224", img_size=32, embed_dim=16, depths=(2, 2),
                             num_heads=(2, 4), window_size=4), _ce, _images(32), _stages("layers", (2, 2)),
          covers="Swin stages with patch merging"),
    Entry("timm/vit", _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2,
                            num_heads=2), _ce, _images(32), layers("blocks"), covers="ViT"),
    Entry("timm/mobilenetv3_small_050", _timm("mobilenetv3_small_050"), _ce, _images(64),
          _stages("blocks", (1, 2, 3, 2, 3), ""), covers="hard-swish, squeeze-excite"),
]  # fmt: skip
