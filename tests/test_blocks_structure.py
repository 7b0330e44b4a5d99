"""find_blocks on small hand-written modules shaped like the models it used to misread.

Each model mimics one structure of the zoo's third round (timm GhostNet, EfficientViT,
MobileOne, EdgeNeXt, HRNet; torchvision Inception-v3 and GoogLeNet) without timm or
torchvision; every model here runs, and its expected blocks are what a person would pick.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

import memfit
from memfit.checkpointing import block_reasons
from memfit.checkpointing.structure import adds_input_back, is_head

CLASSES = 10


def conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out))


class ConvBN(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class Head(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).mean((2, 3)))


# --- adds_input_back: the forms of a residual connection, and what is not one ---------------


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)


class AddsBack(Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.f(x)
        return x


class ShortcutCopy(Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.f(x)
        x = torch.relu(x)
        x += self.f(shortcut)
        return x


class StageLike(Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.f(x)
        x = self.f(x)
        return x


class PositionAdded(Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x) + self.f.bias  # a parameter, not computed from the input


class Fusion(Plain):
    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
        y = x[0]
        for j in range(1, len(x)):
            y = y + self.f(x[j])  # several inputs summed: no identity added back
        return y


class ThroughAList(Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        parts = []
        for chunk in x.chunk(2, dim=-1):
            parts.append(chunk * 2)
        x = torch.cat(parts, -1)
        return shortcut + self.f(x)


def test_adds_input_back_reads_the_residual_connection_from_forward() -> None:
    assert adds_input_back(AddsBack)
    assert adds_input_back(ShortcutCopy)
    assert adds_input_back(ThroughAList)
    assert not adds_input_back(StageLike)
    assert not adds_input_back(PositionAdded)
    assert not adds_input_back(Fusion)
    assert not adds_input_back(nn.Sequential)
    assert not adds_input_back(nn.Linear)


# --- GhostNet: a residual bottleneck of two sub-modules is a block, not a stage -------------


class Ghost(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.primary = nn.Sequential(nn.Conv2d(c_in, c_out // 2, 1), nn.BatchNorm2d(c_out // 2), nn.ReLU())
        self.cheap = nn.Sequential(nn.Conv2d(c_out // 2, c_out // 2, 3, padding=1, groups=c_out // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.primary(x)
        return torch.cat([x1, self.cheap(x1)], dim=1)


class GhostBottleneck(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.ghost1 = Ghost(c_in, 2 * c_out)
        self.ghost2 = Ghost(2 * c_out, c_out)
        self.shortcut = nn.Sequential() if c_in == c_out else nn.Sequential(nn.Conv2d(c_in, c_out, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.ghost1(x)
        x = self.ghost2(x)
        x += self.shortcut(shortcut)
        return x


class GhostNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        stages = [[(8, 8)], [(8, 16)], [(16, 16), (16, 16), (16, 16)]]
        self.blocks = nn.Sequential(*(nn.Sequential(*(GhostBottleneck(a, b) for a, b in s)) for s in stages))
        self.head = Head(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def test_a_residual_unit_of_two_sub_modules_is_the_block() -> None:
    model = GhostNetLike()
    assert model(torch.randn(1, 3, 8, 8)).shape == (1, CLASSES)
    assert memfit.find_blocks(model) == ["blocks.0.0", "blocks.1.0", "blocks.2.0", "blocks.2.1", "blocks.2.2"]
    assert "adds its input back" in block_reasons(model)["blocks.2.1"]


# --- EfficientViT: a block of two residual units; a stem holding one is not a block ---------


class Residual(nn.Module):
    def __init__(self, main: nn.Module, shortcut: bool = True) -> None:
        super().__init__()
        self.main = main
        self.shortcut = nn.Identity() if shortcut else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        res = self.main(x)
        if self.shortcut is not None:
            res = res + self.shortcut(x)
        return res


class MBConv(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.expand = ConvBN(c_in, 2 * c_in)
        self.project = ConvBN(2 * c_in, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(torch.relu(self.expand(x)))


class ContextLocalBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.context_module = Residual(MBConv(c, c))
        self.local_module = Residual(MBConv(c, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.context_module(x)
        x = self.local_module(x)
        return x


class Stage(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_conv = ConvBN(3, 8)
        self.res0 = Residual(MBConv(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res0(self.in_conv(x))


class EfficientViTLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = Stem()
        self.stages = nn.Sequential(
            Stage([Residual(MBConv(8, 16), shortcut=False), Residual(MBConv(16, 16))]),
            Stage([Residual(MBConv(16, 16)), ContextLocalBlock(16), ContextLocalBlock(16)]),
            Stage([Residual(MBConv(16, 24), shortcut=False), ContextLocalBlock(24), ContextLocalBlock(24)]),
        )
        self.head = Head(24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def test_a_block_of_two_residual_units_is_one_block_and_the_stem_is_not_one() -> None:
    model = EfficientViTLike()
    assert model(torch.randn(1, 3, 8, 8)).shape == (1, CLASSES)
    expected = [f"stages.{s}.blocks.{i}" for s, d in enumerate((2, 3, 3)) for i in range(d)]
    assert memfit.find_blocks(model) == expected
    reasons = block_reasons(model)
    assert reasons["stages.0.blocks.0"].startswith("in stages.0.blocks, the place of the repeated blocks")
    assert "ContextLocalBlock" in reasons["stages.1.blocks.1"]


# --- MobileOne: parallel branches in a ModuleList are one block -----------------------------


class MultiBranch(nn.Module):
    def __init__(self, c_in: int, c_out: int, branches: int) -> None:
        super().__init__()
        self.identity = nn.BatchNorm2d(c_out) if c_in == c_out else None
        self.conv_scale = nn.Sequential(nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.conv_kxk = nn.ModuleList(ConvBN(c_in, c_out) for _ in range(branches))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity_out = 0
        if self.identity is not None:
            identity_out = self.identity(x)
        out = self.conv_scale(x)
        for ck in self.conv_kxk:
            out += ck(x)
        out += identity_out
        return torch.relu(out)


class MobileOneLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = MultiBranch(3, 8, 1)
        self.stages = nn.Sequential(
            nn.Sequential(MultiBranch(8, 8, 3), MultiBranch(8, 16, 3)),
            nn.Sequential(MultiBranch(16, 16, 3), MultiBranch(16, 16, 3), MultiBranch(16, 16, 3)),
        )
        self.head = Head(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def test_parallel_branches_in_a_module_list_are_one_block() -> None:
    model = MobileOneLike()
    assert model(torch.randn(1, 3, 8, 8)).shape == (1, CLASSES)
    expected = ["stem", "stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1", "stages.1.2"]
    assert memfit.find_blocks(model) == expected


# --- EdgeNeXt: a block type once per stage, after the repeated ones -------------------------


class TransposedBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.mix = ConvBN(c, c)
        self.mlp = nn.Sequential(nn.Linear(c, c), nn.GELU(), nn.Linear(c, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.mix(x)
        x = self.mlp(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return shortcut + x


class ConvBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = ConvBN(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x)


class DownStage(nn.Module):
    def __init__(self, c_in: int, c: int, convs: int) -> None:
        super().__init__()
        self.downsample = nn.Sequential(nn.BatchNorm2d(c_in), nn.Conv2d(c_in, c, 1))
        self.blocks = nn.Sequential(*(ConvBlock(c) for _ in range(convs)), TransposedBlock(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class EdgeNeXtLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 1)
        self.stages = nn.Sequential(DownStage(8, 8, 2), DownStage(8, 16, 1), DownStage(16, 16, 5))
        self.head = Head(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def test_a_block_type_once_per_stage_is_a_block() -> None:
    model = EdgeNeXtLike()
    assert model(torch.randn(1, 3, 8, 8)).shape == (1, CLASSES)
    expected = [f"stages.{s}.blocks.{i}" for s, d in enumerate((3, 2, 6)) for i in range(d)]
    assert memfit.find_blocks(model) == expected
    why = "in stages.1.blocks beside its repeated blocks (a block type once per stage)"
    assert block_reasons(model)["stages.1.blocks.1"] == why


# --- Inception-v3 and GoogLeNet: reduction blocks once; auxiliary classifiers never ---------


class Mixed(nn.Module):
    """Parallel branches concatenated (no residual connection)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        half = c_out // 2
        self.branch1 = nn.Sequential(nn.Conv2d(c_in, half, 1, stride=stride), nn.BatchNorm2d(half))
        self.branch3 = nn.Sequential(nn.Conv2d(c_in, half, 3, stride=stride, padding=1), nn.BatchNorm2d(half))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch3(x)], 1)


class Reduction(Mixed):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__(c_in, c_out, stride=2)


class Aux(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(c, 8, 1), nn.BatchNorm2d(8))
        self.fc = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean((2, 3)))


class InceptionLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem1 = ConvBN(3, 8)
        self.stem2 = ConvBN(8, 8)
        self.a1, self.a2 = Mixed(8, 8), Mixed(8, 8)
        self.reduce1 = Reduction(8, 16)
        self.c1, self.c2 = Mixed(16, 16), Mixed(16, 16)
        self.aux = Aux(16)
        self.reduce2 = Reduction(16, 24)
        self.e1, self.e2 = Mixed(24, 24), Mixed(24, 24)
        self.fc = nn.Linear(24, CLASSES)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.c2(self.c1(self.reduce1(self.a2(self.a1(self.stem2(self.stem1(x)))))))
        aux = self.aux(x)
        x = self.e2(self.e1(self.reduce2(x)))
        return self.fc(x.mean((2, 3))), aux


def test_reduction_blocks_once_between_runs_are_blocks_and_the_aux_head_is_not() -> None:
    model = InceptionLike()
    assert [t.shape for t in model(torch.randn(1, 3, 8, 8))] == [(1, CLASSES), (1, CLASSES)]
    assert memfit.find_blocks(model) == ["a1", "a2", "reduce1", "c1", "c2", "reduce2", "e1", "e2"]
    assert is_head(model.aux, model) and not is_head(model.c1, model)


class GoogLeNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = ConvBN(3, 8)
        self.i3a, self.i3b, self.i4a = Mixed(8, 8), Mixed(8, 8), Mixed(8, 8)
        self.aux1, self.aux2 = Aux(8), Aux(8)
        self.fc = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.i3a(self.stem(x))
        aux1 = self.aux1(x)
        x = self.i3b(x)
        aux2 = self.aux2(x)
        x = self.i4a(x)
        return self.fc(x.mean((2, 3))), aux2, aux1


def test_two_auxiliary_classifiers_side_by_side_are_not_blocks() -> None:
    model = GoogLeNetLike()
    assert len(model(torch.randn(1, 3, 8, 8))) == 3
    assert memfit.find_blocks(model) == ["i3a", "i3b", "i4a"]


def test_residual_blocks_as_wide_as_the_classes_are_blocks_not_auxiliary_heads() -> None:
    """A byte-level GPT 256 wide with a 256-token vocabulary: each block ends in a Linear with
    as many outputs as the head, yet adds its input back, so it is a block (first seen when
    ``memfit.bench`` refused such a GPT on a GPU: "found no repeated blocks")."""
    from memfit.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=4, n_embd=256, n_head=4, block_size=32, vocab_size=256))
    assert model.blocks[0].mlp.proj.out_features == model.head.out_features
    assert not is_head(model.blocks[0], model)
    assert memfit.find_blocks(model) == [f"blocks.{i}" for i in range(4)]


# --- HRNet: residual units inside parallel branches outrank the containers around them -----


class Basic(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.bn1(self.conv1(x))
        x += shortcut
        return torch.relu(x)


class MultiResolution(nn.Module):
    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Sequential(Basic(c), Basic(c)) for c in widths)
        self.fuse = nn.ModuleList(nn.Conv2d(c, widths[0], 1) for c in widths[1:])

    def forward(self, x: list[torch.Tensor]) -> list[torch.Tensor]:
        x = [b(xi) for b, xi in zip(self.branches, x, strict=True)]
        y = x[0]
        for j, f in enumerate(self.fuse, start=1):
            y = y + nn.functional.interpolate(f(x[j]), size=y.shape[-2:])
        return [y, *x[1:]]


class SequentialList(nn.Sequential):
    """A stage of multi-resolution modules, taking and giving lists (timm HRNet's own class)."""

    def forward(self, x: list[torch.Tensor]) -> list[torch.Tensor]:  # type: ignore[override]
        for module in self:
            x = module(x)
        return x


class HRNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(Residual(MBConv(3, 3)))
        self.stage2 = SequentialList(MultiResolution((3, 6)))
        self.incre_modules = nn.ModuleList(nn.Sequential(Residual(MBConv(c, c))) for c in (3, 6))
        self.head = nn.Linear(9, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer1(x)
        low = torch.nn.functional.avg_pool2d(x, 2).repeat(1, 2, 1, 1)
        ys = self.stage2([x, low])
        feats = [m(y).mean((2, 3)) for m, y in zip(self.incre_modules, ys, strict=True)]
        return self.head(torch.cat(feats, 1))


def test_residual_units_in_branches_outrank_the_containers_around_them() -> None:
    model = HRNetLike()
    assert model(torch.randn(1, 3, 8, 8)).shape == (1, CLASSES)
    expected = ["layer1.0", "stage2.0.branches.0.0", "stage2.0.branches.0.1", "stage2.0.branches.1.0",
                "stage2.0.branches.1.1", "incre_modules.0.0", "incre_modules.1.0"]  # fmt: skip
    assert memfit.find_blocks(model) == expected


# --- DLA: a tree holding blocks beside blocks is not one more block -----------------------


class Tree(nn.Module):
    def __init__(self, c: int, levels: int) -> None:
        super().__init__()
        make = (lambda: Tree(c, levels - 1)) if levels > 1 else (lambda: ConvBlock(c))
        self.tree1, self.tree2 = make(), make()
        self.root = ConvBN(2 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y1 = self.tree1(x)
        return self.root(torch.cat([y1, self.tree2(y1)], 1))


class DLALike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.level1 = Tree(4, 1)
        self.level2 = Tree(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.level2(self.level1(x))


def test_a_module_holding_blocks_is_never_a_block_beside_them() -> None:
    model = DLALike()
    assert model(torch.randn(1, 4, 8, 8)).shape == (1, 4, 8, 8)
    blocks = memfit.find_blocks(model)
    assert blocks == ["level1.tree1", "level1.tree2", "level2.tree1.tree1", "level2.tree1.tree2",
                      "level2.tree2.tree1", "level2.tree2.tree2"]  # fmt: skip
    assert not any(a.startswith(b + ".") for a in blocks for b in blocks)


# --- declared blocks -------------------------------------------------------------------------


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class Declared(nn.Module):
    """Its layers never stand side by side; the model names them in ``_no_split_modules``."""

    _no_split_modules: ClassVar[list[str]] = ["Layer"]

    def __init__(self) -> None:
        super().__init__()
        self.first = Layer()
        self.mid = nn.Linear(4, 4)
        self.second = Layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.mid(self.first(x)))


def test_no_split_modules_are_taken_as_the_blocks_and_say_so() -> None:
    model = Declared()
    assert memfit.find_blocks(model) == ["first", "second"]
    why = "declared in the model's _no_split_modules"
    assert block_reasons(model) == {"first": why, "second": why}
