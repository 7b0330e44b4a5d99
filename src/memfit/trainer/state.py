"""Training-state files: written atomically, authenticated with a key, loaded without pickle code.

This module is the file format only: it writes and reads a dict of tensors and plain data,
and captures and restores the global random generators. What goes into the dict is the
Trainer's business (:meth:`memfit.Trainer.state_dict`).

Trade-off: each save streams the archive into a temporary file and then reads it back once
to sign it (twice the disk reads of a plain ``torch.save``, no second copy in host memory);
in exchange a crash at any moment leaves either the old file or the new one, never a
half-written one.

File layout: ``MEMFIT-STATE-2\\n``, the payload length (8 bytes, little-endian), the
HMAC-SHA256 of the payload (32 bytes), then the payload (a ``torch.save`` archive). The
HMAC key is this user's state key (:func:`state_key`), so a file that was damaged, edited,
or written by anyone without the key is refused before ``torch.load(weights_only=True)``
reads it, and a file never runs code.

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
import hmac
import io
import os
import pickle
import random
import secrets
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.errors import StateError
from memfit.reading import read_bounded

__all__ = [
    "KEY_ENV",
    "capture_rng",
    "file_digest",
    "load_state",
    "previous_path",
    "remove_stale_temporaries",
    "restore_rng",
    "save_state",
    "state_key",
    "verify_state",
]

_MAGIC = b"MEMFIT-STATE-2\n"
_OLD_MAGIC = b"MEMFIT-STATE-1\n"
_HEADER = len(_MAGIC) + 8 + 32
#: Environment variable naming the key file (default ``~/.config/memfit/state.key``).
KEY_ENV = "MEMFIT_STATE_KEY"


def previous_path(path: str | os.PathLike[str]) -> Path:
    """Where the state before ``path`` is kept: ``state.pt`` -> ``state.prev.pt``."""
    p = Path(path)
    return p.with_name(f"{p.stem}.prev{p.suffix}")


def _key_path() -> Path:
    named = os.environ.get(KEY_ENV)
    if named:
        return Path(named).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "memfit" / "state.key"


def state_key(create: bool = True) -> bytes:
    """This user's key for authenticating state files (32 random bytes, created once, mode 0600).

    The key is ``$MEMFIT_STATE_KEY``'s file, or ``~/.config/memfit/state.key``.
    """
    # The key lives with the user, not with the run, so a run directory copied from elsewhere,
    # key and all, is not trusted by accident. It is created by a link of a finished temporary
    # file, so two processes starting at once agree on one key.
    path = _key_path()
    key = _read_key(path)
    if key is None and not create:
        raise StateError(
            f"the state key {str(path)!r} does not exist, so no state file can be authenticated; "
            f"set {KEY_ENV} to the key file of the account that wrote it."
        )
    if key is None:
        try:
            _create_key(path)
        except OSError as exc:
            raise StateError(f"cannot write the state key {str(path)!r} ({exc.strerror or exc}).") from None
        key = _read_key(path) or b""
    if len(key) < 16:
        raise StateError(f"the state key {str(path)!r} is too short; delete it and a new one is made.")
    return key


#: A state key is 32 bytes; a key file larger than this is not one.
_MAX_KEY_BYTES = 4096


def _read_key(path: Path) -> bytes | None:
    """The key file's bytes (a regular file of at most 4 KiB), or None when there is none."""
    if not os.path.lexists(path):
        return None
    return read_bounded(
        path, "the state key", _MAX_KEY_BYTES, error=StateError,
        hint=f"set {KEY_ENV} to a key file memfit made (32 random bytes), or unset it.",
    )  # fmt: skip


def _create_key(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".state.key.", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secrets.token_bytes(32))
        os.close(fd)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _mac(key: bytes, payload: bytes | memoryview) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).digest()


def file_digest(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes, as hex (used to pin shard files to a state file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(directory: Path) -> None:
    # The rename is only durable once the directory entry is on disk; some platforms
    # (Windows) cannot open a directory, which is harmless to skip.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove_stale_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """Delete ``.state.pt.*.tmp`` files a killed save left beside ``path``; returns them."""
    path = Path(path)
    stale = list(path.parent.glob(f".{path.name}.*.tmp")) if path.parent.is_dir() else []
    for tmp in stale:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return stale


def save_state(state: dict[str, Any], path: str | os.PathLike[str], keep_previous: bool = True) -> Path:
    """Write ``state`` to ``path`` atomically; the file before it becomes ``state.prev.pt``.

    The bytes go to a temporary file in the same directory, are flushed and fsynced, and
    only then replace ``path`` (``os.replace``), so readers see the old file or the
    complete new one. The directory is fsynced so the rename survives a power cut.
    Temporary files of saves that were killed half-way are removed.

    Args:
        state: tensors and plain data (dicts, lists, numbers, strings).
        path: the file to write; its directory is created if needed.
        keep_previous: move the existing file to :func:`previous_path` first, so one
            older good state is always on disk.

    Returns:
        ``path`` as a Path.

    Raises:
        OSError: the file cannot be written (the old files are then untouched).
    """
    path = Path(path)
    key = state_key()
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w+b") as f:
            _write_signed(f, state, key)
        if keep_previous and path.exists():
            os.replace(path, previous_path(path))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def _write_signed(f: Any, state: dict[str, Any], key: bytes) -> None:
    """Header placeholder, the ``torch.save`` archive streamed to the file, then the header."""
    # Streamed, not built in memory first: a save needs no second copy of the state in host
    # memory (the save after an out-of-memory re-plan failed that way). The archive's offsets
    # are its own, so the payload loads from any position.
    f.write(b"\0" * _HEADER)
    torch.save(state, f)
    length = f.tell() - _HEADER
    f.seek(_HEADER)
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for chunk in iter(lambda: f.read(1 << 20), b""):
        mac.update(chunk)
    f.seek(0)
    f.write(_MAGIC + struct.pack("<Q", length) + mac.digest())
    f.flush()
    os.fsync(f.fileno())


def _payload(path: Path) -> bytes:
    """The authenticated payload of a state file; raises a one-sentence StateError otherwise."""
    if path.is_dir():
        raise StateError(f"training state {str(path)!r} is a directory; give the path of a state.pt file.")
    size = _regular_size(path)
    data = read_bounded(
        path, "training state", size, error=StateError, hint="give the path of a state.pt file."
    )
    if data.startswith(_OLD_MAGIC):
        raise StateError(
            f"training state {str(path)!r} was written by an older memfit without authentication; "
            "start a new run (its weights cannot be trusted)."
        )
    if not data.startswith(_MAGIC):
        raise StateError(f"{str(path)!r} is not a memfit training state (its header is wrong).")
    if len(data) < _HEADER:
        raise StateError(f"training state {str(path)!r} is truncated ({len(data)} bytes, header incomplete).")
    (length,) = struct.unpack("<Q", data[len(_MAGIC) : len(_MAGIC) + 8])
    payload = memoryview(data)[_HEADER:]
    if len(payload) != length:
        raise StateError(
            f"training state {str(path)!r} is truncated: it holds {len(payload)} of {length} payload bytes."
        )
    if not hmac.compare_digest(_mac(state_key(create=False), payload), data[len(_MAGIC) + 8 : _HEADER]):
        raise StateError(
            f"training state {str(path)!r} is damaged or was not written with this user's state key: "
            "its checksum (HMAC-SHA256) does not match."
        )
    return bytes(payload)


def _regular_size(path: Path) -> int:
    """The size of ``path`` (what a read of it is bounded by); a missing file is one sentence."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise StateError(f"training state {str(path)!r} does not exist.") from None
    except OSError as exc:
        raise StateError(f"cannot read training state {str(path)!r} ({exc.strerror or exc}).") from None


def verify_state(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a complete, undamaged state file written with this user's key."""
    try:
        _payload(Path(path))
    except StateError:
        return False
    return True


def load_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a state file written by :func:`save_state`, refusing damaged or forged ones.

    Returns:
        The saved dict, tensors on the CPU.

    Raises:
        StateError: the file is missing, truncated, damaged, not authenticated by this
            user's key, or holds something other than tensors and plain data; the message
            names the intact previous state when there is one.
    """
    path = Path(path)
    try:
        payload = _payload(path)
        try:
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
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
