"""The zoo's third round: models whose blocks a person picks by structure: residual units of two
sub-modules, parallel branches, one block type per stage, auxiliary heads.

Every setting not given here is the library's default (torchvision's GoogLeNet and Inception-v3
keep their auxiliary classifiers, on by default without weights, and return them in train mode).
"""

from __future__ import annotations

import torch
from torch import nn
from zoo import Entry
from zoo_vision import _ce, _images, _timm, _tv  # the zoo's own builders

#: The weight torchvision's own reference training gives each auxiliary classifier's loss.
AUX_WEIGHT = 0.3


def _ce_with_aux(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Main cross-entropy plus 0.3x each auxiliary classifier's (the train-mode named tuple)."""
    x, y = batch
    out = model(x)
    main, *aux = out  # InceptionOutputs(logits, aux_logits), GoogLeNetOutputs(logits, aux2, aux1)
    loss = nn.functional.cross_entropy(main, y)
    for logits in aux:
        loss = loss + AUX_WEIGHT * nn.functional.cross_entropy(logits, y)
    return loss


def _per_stage(fmt: str, depths: tuple[int, ...]) -> list[str]:
    """``fmt.format(stage, block)`` for stages of these depths."""
    return [fmt.format(s, i) for s, d in enumerate(depths) for i in range(d)]


def _ghostnet() -> list[str]:
    return _per_stage("blocks.{}.{}", (1, 1, 1, 1, 1, 1, 5, 1, 4))


def _hrnet() -> list[str]:
    branches = [f"stage{s}.0.branches.{b}.{i}" for s in (2, 3, 4) for b in range(s) for i in range(2)]
    return ["layer1.0", *branches, *(f"incre_modules.{i}.0" for i in range(4))]


_INCEPTION3 = ["Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a", "Mixed_6b", "Mixed_6c", "Mixed_6d",
               "Mixed_6e", "Mixed_7a", "Mixed_7b", "Mixed_7c"]  # fmt: skip
_GOOGLENET = [f"inception{s}" for s in ("3a", "3b", "4a", "4b", "4c", "4d", "4e", "5a", "5b")]

# timm MobileOne and EdgeNeXt read their drop-path rates with ``.item()``/``.tolist()`` while
# being built, and torchvision GoogLeNet and Inception-v3 run ``trunc_normal_`` in their init:
# memfit.estimate builds them on the meta device (measuring/fakebuild.py).
BLOCKS3: list[Entry] = [
    Entry("timm/ghostnet_050", _timm("ghostnet_050"), _ce, _images(64), _ghostnet(), estimate=True,
          covers="a residual bottleneck of two ghost modules and a shortcut: a block, not a stage"),
    Entry("timm/efficientvit_b0", _timm("efficientvit_b0"), _ce, _images(64),
          _per_stage("stages.{}.blocks.{}", (2, 2, 3, 3)), estimate=True,
          covers="a block of two residual units (context, local); down-sampling block first in a stage; "
                 "a stem with a residual unit, not a block"),
    Entry("timm/mobileone_s0", _timm("mobileone_s0"), _ce, _images(64),
          ["stem", *_per_stage("stages.{}.{}", (4, 16, 20, 2))], estimate=True,
          covers="parallel conv branches in a ModuleList, summed with an identity: one block"),
    Entry("timm/edgenext_xx_small", _timm("edgenext_xx_small"), _ce, _images(64),
          _per_stage("stages.{}.blocks.{}", (2, 2, 6, 2)), estimate=True,
          covers="a transposed-attention block once per stage, after the conv blocks"),
    # 75x75 is Inception-v3's smallest input without its auxiliary classifier; with it (the
    # default), the classifier's 5x5 pooling needs a 17x17 map: 299x299 images.
    Entry("torchvision/inception_v3", _tv("inception_v3"), _ce_with_aux, _images(299), _INCEPTION3, large=4,
          estimate=True, covers="reduction blocks once between runs; an auxiliary classifier off the chain"),
    Entry("torchvision/googlenet", _tv("googlenet"), _ce_with_aux, _images(64), _GOOGLENET, estimate=True,
          covers="two auxiliary classifiers side by side as attributes: heads, not blocks"),
    Entry("timm/hrnet_w18_small", _timm("hrnet_w18_small"), _ce, _images(64), _hrnet(),
          large=32, estimate=True,
          covers="residual units inside parallel branches and single-block containers; list inputs"),
]  # fmt: skip
