"""Reading user files with bounds: configs, plans, data, state files and keys.

Every file memfit reads on a user's word is opened here, so each read is bounded and never
blocks: the file is opened without waiting (``O_NONBLOCK``, so a FIFO nobody writes to does
not hang), must be a regular file (a FIFO, ``/dev/zero`` or a socket is refused in one
sentence naming what it is), and at most ``limit`` bytes are read (the rest is refused, or
left unread where a prefix is what is wanted, as ``data.max_bytes`` asks).

Trade-off: a named pipe or ``/dev/stdin`` cannot be given as a config, plan or corpus; a
regular file (or a directory of them, for data) always can.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> p = Path(tempfile.mkdtemp()) / "a.txt"
    >>> _ = p.write_bytes(b"hello world")
    >>> read_bounded(p, "data path", 5, whole=False)
    b'hello'
    >>> read_bounded(p, "config file", 5)
    Traceback (most recent call last):
    ...
    memfit.errors.ConfigError: config file '...a.txt' is larger than 5 B; give a smaller file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from memfit.budget import format_bytes
from memfit.errors import ConfigError, MemfitError

__all__ = ["file_kind", "read_bounded", "read_prefix"]

_KINDS = (
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISDIR, "directory"),
)


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words (``"FIFO (named pipe)"``); ``"file"`` otherwise."""
    return next((name for test, name in _KINDS if test(mode)), "file")


def _open(path: Path) -> int | None:
    """A descriptor of ``path`` if it is a regular file, else None (closed); OSError as raised."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    return None


#: Bytes read at a time: ``f.read(limit)`` would allocate ``limit`` bytes at once, whatever
#: the file's size (a 1 GiB bound on a 1 KiB file is a 1 GiB buffer).
_CHUNK = 1 << 20


def _read(fd: int, limit: int) -> bytes:
    parts: list[bytes] = []
    left = limit
    with os.fdopen(fd, "rb") as f:
        while left > 0:
            part = f.read(min(_CHUNK, left))
            if not part:
                break
            parts.append(part)
            left -= len(part)
    return b"".join(parts)


def read_bounded(
    path: str | os.PathLike[str],
    what: str,
    limit: int,
    *,
    whole: bool = True,
    hint: str = "give a smaller file.",
    error: type[MemfitError] = ConfigError,
) -> bytes:
    """The bytes of the regular file ``path``: all of them (``whole``), at most ``limit``.

    Args:
        path: the file.
        what: its name in messages (``"config file"``, ``"data path"``).
        limit: the most bytes read.
        whole: True: a larger file is refused; False: its first ``limit`` bytes are returned.
        hint: the end of the sentences that refuse a file: what to give instead.
        error: the :class:`MemfitError` subclass raised.

    Raises:
        MemfitError: (``error``) the file does not exist, is a directory, a FIFO, a device or a
            socket, cannot be read, or (``whole``) is larger than ``limit``; one sentence.
    """
    p = Path(path)
    try:
        fd = _open(p)
        if fd is None:
            kind = file_kind(os.stat(p).st_mode)
            raise error(f"{what} {str(p)!r} is a {kind}, not a regular file; {hint}")
        data = _read(fd, limit + 1 if whole else limit)
    except FileNotFoundError:
        raise error(f"{what} {str(p)!r} does not exist; {hint}") from None
    except OSError as exc:
        raise error(f"cannot read {what} {str(p)!r} ({exc.strerror or exc}).") from None
    if whole and len(data) > limit:
        raise error(f"{what} {str(p)!r} is larger than {format_bytes(limit)}; {hint}")
    return data


def read_prefix(path: str | os.PathLike[str], limit: int) -> bytes | None:
    """At most ``limit`` bytes of ``path``; None when it is not a regular file or cannot be read
    (a corpus directory's FIFOs, devices and unreadable files are skipped, not waited on)."""
    try:
        fd = _open(Path(path))
        return None if fd is None else _read(fd, limit)
    except OSError:
        return None
