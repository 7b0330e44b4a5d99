"""Training-state files: written atomically, verified by checksum, loaded without pickle code.

A state file holds everything a run needs to continue exactly where it stopped: model,
optimizer, loss scaler, learning-rate schedule, RNG states (torch, CUDA, numpy, python),
the data sampler's position and the step count.

Trade-off: each save serializes the whole state into memory first and writes it once,
so a save briefly needs the state's size in host memory; in exchange a crash at any
moment leaves either the old file or the new one, never a half-written one.

File layout: ``MEMFIT-STATE-1\\n``, the payload length (8 bytes, little-endian), the
SHA-256 of the payload (32 bytes), then the payload (a ``torch.save`` archive). Loading
checks length and checksum before ``torch.load(weights_only=True)`` reads the payload, so
a truncated or damaged file is refused with a clear error and a file never runs code.

Example:
    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = save_state({"step": 1, "w": torch.ones(2)}, d / "state.pt")
    >>> _ = save_state({"step": 2, "w": torch.ones(2)}, d / "state.pt")
    >>> load_state(d / "state.pt")["step"], load_state(d / "state.prev.pt")["step"]
    (2, 1)
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import random
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from memfit.errors import StateError
from memfit.train.distributed import unwrap

if TYPE_CHECKING:
    from memfit.train.trainer import Trainer

__all__ = [
    "capture_rng",
    "load_state",
    "previous_path",
    "restore_rng",
    "restore_trainer",
    "save_state",
    "trainer_state",
    "verify_state",
]

_FORMAT = "memfit-training-state"
_MAGIC = b"MEMFIT-STATE-1\n"
_HEADER = len(_MAGIC) + 8 + 32


def previous_path(path: str | os.PathLike[str]) -> Path:
    """Where the state before ``path`` is kept: ``state.pt`` -> ``state.prev.pt``."""
    p = Path(path)
    return p.with_name(f"{p.stem}.prev{p.suffix}")


def _fsync_dir(directory: Path) -> None:
    # NOTE: the rename is only durable once the directory entry is on disk; some
    # platforms (Windows) cannot open a directory, which is harmless to skip.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_state(state: dict[str, Any], path: str | os.PathLike[str], keep_previous: bool = True) -> Path:
    """Write ``state`` to ``path`` atomically; the file before it becomes ``state.prev.pt``.

    The bytes go to a temporary file in the same directory, are flushed and fsynced, and
    only then replace ``path`` (``os.replace``), so readers see the old file or the
    complete new one. The directory is fsynced so the rename survives a power cut.

    Args:
        state: tensors and plain data (dicts, lists, numbers, strings).
        path: the file to write; its directory is created if needed.
        keep_previous: move the existing file to :func:`previous_path` first, so one
            older good state is always on disk.

    Returns:
        ``path`` as a Path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + struct.pack("<Q", len(payload)) + hashlib.sha256(payload).digest())
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.exists():
            os.replace(path, previous_path(path))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def _payload(path: Path) -> bytes:
    """The verified payload of a state file; raises a one-sentence StateError otherwise."""
    if not path.is_file():
        raise StateError(f"training state {str(path)!r} does not exist.")
    data = path.read_bytes()
    if not data.startswith(_MAGIC):
        raise StateError(f"{str(path)!r} is not a memfit training state (its header is wrong).")
    if len(data) < _HEADER:
        raise StateError(f"training state {str(path)!r} is truncated ({len(data)} bytes, header incomplete).")
    (length,) = struct.unpack("<Q", data[len(_MAGIC) : len(_MAGIC) + 8])
    payload = data[_HEADER:]
    if len(payload) != length:
        raise StateError(
            f"training state {str(path)!r} is truncated: it holds {len(payload)} of {length} payload bytes."
        )
    if hashlib.sha256(payload).digest() != data[len(_MAGIC) + 8 : _HEADER]:
        raise StateError(f"training state {str(path)!r} is damaged: its checksum does not match.")
    return payload


def verify_state(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a complete, undamaged state file."""
    try:
        _payload(Path(path))
    except StateError:
        return False
    return True


def load_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a state file written by :func:`save_state`, refusing damaged ones.

    Returns:
        The saved dict, tensors on the CPU.

    Raises:
        StateError: the file is missing, truncated, damaged, or holds something other
            than tensors and plain data; the message names the intact previous state
            when there is one.
    """
    path = Path(path)
    try:
        payload = _payload(path)
        try:
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StateError(
                f"training state {str(path)!r} cannot be loaded safely (weights_only): {first}"
            ) from None
    except StateError as exc:
        prev = previous_path(path)
        if prev != path and verify_state(prev):
            raise StateError(
                f"{str(exc).rstrip('.')}; the previous training state {str(prev)!r} is intact: "
                f"resume from it (memfit train --resume {prev})."
            ) from None
        raise
    if not isinstance(state, dict):
        raise StateError(f"training state {str(path)!r} holds {type(state).__name__}, not a dict.")
    return state


def capture_rng() -> dict[str, Any]:
    """The states of torch's, CUDA's, numpy's and python's global random generators."""
    np_state = np.random.get_state(legacy=False)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np.asarray(np_state["state"]["key"]).astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "python": list(random.getstate()),
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng` returned."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": n["bit_generator"],
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def trainer_state(
    trainer: Trainer, data: Any | None = None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What :meth:`memfit.Trainer.save` writes: model, optimizer, precision (loss scaler),
    scheduler, RNG states, ``data.state_dict()``, the step count and ``extra``.

    The model's state is that of the model inside a DDP wrapper, so its keys are the same
    with and without DDP."""
    return {
        "format": _FORMAT,
        "version": 1,
        "step": trainer.step_count,
        "model": unwrap(trainer.model).state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "precision": trainer.precision.state_dict(),
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        "rng": capture_rng(),
        "data": data.state_dict() if data is not None else None,
        "extra": extra or {},
    }


def restore_trainer(trainer: Trainer, state: dict[str, Any], data: Any | None = None) -> dict[str, Any]:
    """Put :func:`trainer_state` back into ``trainer`` (and ``data``); returns ``extra``.

    Raises:
        StateError: the state is not a Trainer's, or its model does not fit this one.
    """
    if state.get("format") != _FORMAT:
        raise StateError("this file is not a memfit Trainer state; write one with Trainer.save().")
    # NOTE: an FSDP2 state holds no "model" and "optimizer": their shards were loaded with DCP.
    try:
        if "model" in state:
            unwrap(trainer.model).load_state_dict(state["model"])
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise StateError(
            f"the saved model does not fit this model ({first.rstrip('.:')}); resume with the same model."
        ) from None
    if "optimizer" in state:
        trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.precision.load_state_dict(state["precision"])
    if trainer.scheduler is not None and state.get("scheduler") is not None:
        trainer.scheduler.load_state_dict(state["scheduler"])
    if data is not None and state.get("data") is not None:
        data.load_state_dict(state["data"])
    restore_rng(state["rng"])
    trainer.step_count = int(state["step"])
    return dict(state.get("extra") or {})
