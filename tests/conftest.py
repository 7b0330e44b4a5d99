"""Shared test fixtures: small models of several shapes, all CPU, all seeded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from memfit.models.gpt import GPT, GPTConfig
from memfit.models.spec import ModelSpec

# NOTE: the test models are tiny; on a shared CPU, torch's intra-op threads cost more than
# they gain (a 4-5x slowdown under load), so tests run single-threaded.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _state_key(tmp_path_factory: pytest.TempPathFactory) -> None:
    """State files are signed with a key in the test session's own folder, not the user's home."""
    import os

    if "MEMFIT_STATE_KEY" not in os.environ:
        os.environ["MEMFIT_STATE_KEY"] = str(tmp_path_factory.mktemp("key") / "state.key")


def tiny_gpt(dropout: float = 0.0, n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_embd=32, n_head=2, block_size=16, dropout=dropout))


def token_batch(batch: int = 3, seq: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (batch, seq + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


class ConvBlock(nn.Module):
    """conv -> BatchNorm -> ReLU with a residual connection."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.conv(x)))


class SmallCNN(nn.Module):
    """A CNN with BatchNorm in every block."""

    def __init__(self, ch: int = 8, n_blocks: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvBlock(ch) for _ in range(n_blocks)])
        self.head = nn.Linear(ch, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))
        return self.head(h.mean(dim=(2, 3)))


def cnn_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def image_batch(batch: int = 4, size: int = 8, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g)


class DropoutMLP(nn.Module):
    """Residual MLP blocks with dropout."""

    def __init__(self, width: int = 32, n_blocks: int = 4, p: float = 0.3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(p)) for _ in range(n_blocks)
        )
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def vector_batch(batch: int = 8, width: int = 32, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, width, generator=g), torch.randn(batch, 1, generator=g)


class WideBlock(nn.Module):
    """A residual MLP block whose hidden width is its own: blocks of different sizes."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class VariedMLP(nn.Module):
    """Residual blocks of very different sizes (hidden widths 16 to 512)."""

    def __init__(self, width: int = 32, hidden: tuple[int, ...] = (16, 512, 64, 256, 32, 128)) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(WideBlock(width, h) for h in hidden)
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class UStage(nn.Module):
    """conv -> ReLU -> conv -> ReLU at one resolution (a U-Net stage)."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv2(torch.relu(self.conv1(x))))


class TinyUNet(nn.Module):
    """A U-Net-like model: encoder outputs are held across blocks and concatenated into the decoder."""

    def __init__(self, ch: int = 4, depth: int = 2) -> None:
        super().__init__()
        widths = [ch * 2**i for i in range(depth + 1)]
        stages = [UStage(3, widths[0])]
        stages += [UStage(widths[i], widths[i + 1]) for i in range(depth)]
        stages += [UStage(widths[i + 1] + widths[i], widths[i]) for i in reversed(range(depth))]
        self.stages = nn.ModuleList(stages)
        self.depth = depth
        self.head = nn.Conv2d(widths[0], 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        h = self.stages[0](x)
        for i in range(self.depth):
            skips.append(h)
            h = self.stages[1 + i](nn.functional.max_pool2d(h, 2))
        for i in range(self.depth):
            up = nn.functional.interpolate(h, scale_factor=2.0, mode="nearest")
            h = self.stages[1 + self.depth + i](torch.cat([up, skips.pop()], dim=1))
        return self.head(h)


def image_regression_batch(
    batch: int = 4, size: int = 16, seed: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g), torch.randn(batch, 3, size, size, generator=g)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(1234)


class ResidualMLP(nn.Module):
    """x + fc2(gelu(fc1(x))) with its own hidden width."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class UnevenMLP(nn.Module):
    """Blocks of one class whose sizes differ (hidden widths 16, 96, 40)."""

    def __init__(self, width: int = 24, hiddens: tuple[int, ...] = (16, 96, 40)) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(ResidualMLP(width, h) for h in hiddens)
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def uneven_batch(batch: int = 96, width: int = 24, seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, width, generator=g), torch.randn(batch, 1, generator=g)


def mismatched_spec() -> ModelSpec:
    """A factory (``import:conftest:mismatched_spec``) whose batches do not fit its model."""
    return ModelSpec(
        model=UnevenMLP(),
        loss_fn=mse_loss,
        make_batch=lambda n, seed: (torch.randn(n, 7), torch.randn(n, 1)),
    )


def blockless_spec() -> ModelSpec:
    """A factory (``import:conftest:blockless_spec``) for a model without repeated blocks."""
    return ModelSpec(
        model=nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)),
        loss_fn=mse_loss,
        make_batch=lambda n, seed: (torch.randn(n, 8), torch.randn(n, 1)),
    )


class BasicBlock(nn.Module):
    """ResNet's basic block: conv-BN-ReLU(inplace)-conv-BN, in-place residual add, a strided
    1x1 conv + BN shortcut where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNetish(nn.Module):
    """A ResNet-style CNN with BatchNorm: a full-resolution stem, then stages that halve the
    resolution and double the width (the stem's backward is the step's largest moment)."""

    def __init__(self, width: int = 16, layers: tuple[int, ...] = (2, 2, 2), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        stages, cin = [], width
        for i, n in enumerate(layers):
            cout = width * 2**i
            blocks = [BasicBlock(cin, cout, 1 if i == 0 else 2)] + [
                BasicBlock(cout, cout) for _ in range(n - 1)
            ]
            stages.append(nn.Sequential(*blocks))
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.stages(self.stem(x)).mean(dim=(2, 3)))


@pytest.fixture(scope="module")
def one_compile_thread() -> Iterator[None]:
    # NOTE: on a 2-core machine inductor's pool of compile workers costs more than it saves.
    import torch._inductor.config as inductor_config

    before = inductor_config.compile_threads
    inductor_config.compile_threads = 1
    yield
    inductor_config.compile_threads = before
    torch._dynamo.reset()
