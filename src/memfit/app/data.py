"""A byte-level text corpus with a train/validation split and a resumable batch sampler.

Text is read as raw bytes (vocabulary 256), so any file is valid input and no tokenizer
is needed. The demo's corpus is the Python standard library's own source files, found
through ``sysconfig``: real text that is on every machine that runs memfit.

Example:
    >>> corpus = ByteCorpus.from_bytes(bytes(range(256)) * 40, val_fraction=0.1)
    >>> sampler = BatchSampler(corpus.train, batch_size=2, seq_len=8, seed=0)
    >>> x, y = sampler.next_batch()
    >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
    (torch.Size([2, 8]), True)
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.errors import ConfigError
from memfit.reading import read_bounded, read_prefix

__all__ = ["MAX_DATA_BYTES", "BatchSampler", "ByteCorpus", "SyntheticBatches", "stdlib_source_dir"]

#: The most text a corpus holds in memory (``data.max_bytes`` above it is read as this much).
MAX_DATA_BYTES = 2**34

_TEXT_SUFFIXES = (
    ".py",
    ".txt",
    ".md",
    ".rst",
    ".toml",
    ".json",
    ".cfg",
    ".ini",
    ".html",
    ".c",
    ".h",
)


def stdlib_source_dir() -> Path:
    """The directory holding the Python standard library's source files."""
    return Path(sysconfig.get_paths()["stdlib"])


def _read_dir(root: Path, max_bytes: int) -> bytes:
    """The text files under ``root`` (sorted, recursive), read only up to ``max_bytes`` in all;
    FIFOs, devices and unreadable files are skipped."""
    parts: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in {"site-packages", "__pycache__"} and not d.startswith(".")
        )
        for name in sorted(filenames):
            if not name.endswith(_TEXT_SUFFIXES):
                continue
            data = read_prefix(Path(dirpath) / name, max_bytes - total)
            if data is None:
                continue
            parts.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"\n".join(parts)[:max_bytes]
    return b"\n".join(parts)


@dataclass
class ByteCorpus:
    """Bytes split into a training part and a validation part (the last fraction)."""

    train: np.ndarray
    val: np.ndarray
    source: str

    @classmethod
    def from_bytes(cls, data: bytes, val_fraction: float = 0.05, source: str = "<bytes>") -> ByteCorpus:
        """Split ``data``; the last ``val_fraction`` of it is for validation."""
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be between 0 and 1, got {val_fraction!r}.")
        arr = np.frombuffer(data, dtype=np.uint8)
        cut = int(len(arr) * (1.0 - val_fraction))
        return cls(train=arr[:cut], val=arr[cut:], source=source)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], val_fraction: float = 0.05, max_bytes: int | None = None
    ) -> ByteCorpus:
        """Read a text file, or every text file under a directory (sorted, recursive).

        ``path="stdlib"`` reads the Python standard library's source files. Only the first
        ``max_bytes`` (at most :data:`MAX_DATA_BYTES`) are read, never the whole file first;
        a FIFO, a device or a socket is refused (inside a directory: skipped).

        Raises:
            ConfigError: the path does not exist, is not a regular file or directory, cannot
                be read, or holds under 1 KiB of text.
        """
        root = stdlib_source_dir() if str(path) == "stdlib" else Path(path)
        limit = MAX_DATA_BYTES if max_bytes is None else min(max_bytes, MAX_DATA_BYTES)
        hint = "set data.path to a text file, a directory of text files, or 'stdlib'."
        try:
            is_dir = root.is_dir()
        except OSError as exc:
            raise ConfigError(f"cannot read data path {str(root)!r} ({exc.strerror or exc}).") from None
        if is_dir:
            data = _read_dir(root, limit)
        else:
            data = read_bounded(root, "data path", limit, whole=False, hint=hint)
        if len(data) < 1024:
            raise ConfigError(
                f"data path {str(root)!r} holds only {len(data)} bytes of text; give at least 1 KiB."
            )
        return cls.from_bytes(data, val_fraction, source=str(root))


class _Resumable:
    """Batches numbered from 0; batch ``i`` depends only on ``seed`` and ``i``.

    The position (the number of the next batch) can be saved and restored, so a restored
    sampler yields exactly the batches an uninterrupted one would.
    """

    seed: int
    position: int

    def batch_at(self, index: int) -> Any:
        """The batch number ``index``, without moving."""
        raise NotImplementedError

    def next_batch(self) -> Any:
        """The next batch; advances the position."""
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[Any]:
        """Batches from the current position on, without end (each one advances it)."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Position and seed, for training-state files."""
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.position = int(state["position"])
        self.seed = int(state["seed"])


class BatchSampler(_Resumable):
    """Deterministic random windows of a byte array; its position can be saved and restored."""

    def __init__(self, data: np.ndarray, batch_size: int, seq_len: int, seed: int = 0) -> None:
        if len(data) <= seq_len + 1:
            raise ConfigError(
                f"the corpus part has {len(data)} bytes, too few for sequences of {seq_len}; "
                "use more text or a smaller model.block_size."
            )
        self.data = data
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.position = 0

    def batch_at(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch number ``index`` (inputs, next-byte targets), without moving."""
        rng = np.random.default_rng([self.seed, index])
        starts = rng.integers(0, len(self.data) - self.seq_len - 1, size=self.batch_size)
        window = np.stack([self.data[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        t = torch.from_numpy(window)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch; advances the position."""
        batch: tuple[torch.Tensor, torch.Tensor] = super().next_batch()
        return batch


class SyntheticBatches(_Resumable):
    """Batches from a model's own ``make_batch(batch_size, seed)``, resumable like a sampler.

    Batch ``i`` is ``make_batch(batch_size, seed * 1_000_003 + i)``, so it depends only on
    ``seed`` and ``i``.
    """

    def __init__(self, make_batch: Callable[[int, int], Any], batch_size: int, seed: int = 0) -> None:
        self.make_batch = make_batch
        self.batch_size = batch_size
        self.seed = seed
        self.position = 0

    def batch_at(self, index: int) -> Any:
        """The batch number ``index``, without moving."""
        return self.make_batch(self.batch_size, self.seed * 1_000_003 + index)
