"""Output paths: checked before any work starts, written atomically when the work is done.

Every command that writes files checks its output paths first, so a typo or a read-only
directory is refused in one sentence before minutes of measuring, not after; the files
themselves are written to a temporary name and renamed, so a failure never leaves half a
file in place of a good one.

Trade-off: the check creates and deletes one empty temporary file in the nearest existing
directory (the only reliable test of writability, also for root); nothing else is written
before the work.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> d = Path(tempfile.mkdtemp())
    >>> check_output_file(d / "plan.json", "--out") == d / "plan.json"
    True
    >>> write_text(d / "plan.json", marked_json("plan", {"blocks": {}}), "--out").read_text().split()
    ['{', '"memfit":', '"plan",', '"blocks":', '{}', '}']
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from memfit.errors import ConfigError

__all__ = ["MARKER", "check_output_dir", "check_output_file", "marked_json", "write_text"]


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path.cwd()


def _check_writable(directory: Path, path: Path, what: str) -> None:
    if not directory.is_dir():
        raise ConfigError(
            f"{what} {str(path)!r} is inside {str(directory)!r}, which is a file; give another path."
        )
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{what} {str(path)!r} cannot be written: {str(directory)!r} is not writable "
            f"({exc.strerror or exc}); give another path."
        ) from None


def _unusable(p: Path, what: str, exc: OSError) -> ConfigError:
    return ConfigError(f"{what} {str(p)!r} cannot be used ({exc.strerror or exc}); give another path.")


def check_output_dir(path: str | os.PathLike[str], what: str) -> Path:
    """Refuse a directory for output that is a file or cannot be created or written.

    Nothing is created; the nearest existing directory is tested for writing.

    Raises:
        ConfigError: one sentence naming ``what`` (e.g. ``"--out"``) and the path.
    """
    p = Path(path)
    try:
        if p.exists() and not p.is_dir():
            raise ConfigError(f"{what} {str(p)!r} is a file; give a directory.")
        _check_writable(_nearest_existing(p), p, what)
    except OSError as exc:
        raise _unusable(p, what, exc) from None
    return p


#: An existing file larger than this is not read to see whether it is memfit's own output.
_LARGEST_OWN_FILE = 64 * 2**20
#: The field every JSON file memfit writes carries: the kind of file (``"plan"``, ``"profile"``).
MARKER = "memfit"


def marked_json(kind: str, data: dict[str, Any]) -> str:
    """``data`` as the text of a JSON file memfit writes: a :data:`MARKER` field naming ``kind``
    first (records read back with ``from_json`` ignore it)."""
    return json.dumps({MARKER: kind, **data}, indent=2) + "\n"


def _is_marked(p: Path) -> bool:
    """Whether ``p`` is a regular file holding a JSON object with memfit's :data:`MARKER`."""
    try:
        if not p.is_file() or p.stat().st_size > _LARGEST_OWN_FILE:
            return False
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and isinstance(data.get(MARKER), str)


def check_output_file(path: str | os.PathLike[str], what: str) -> Path:
    """Refuse a file path for output that is a directory, or whose directory cannot be written,
    or an existing file without memfit's marker (a ``"memfit"`` field, which every JSON file
    memfit writes carries): a mistyped ``--out`` must not replace a file memfit did not write.

    Raises:
        ConfigError: one sentence naming ``what`` and the path.
    """
    p = Path(path)
    try:
        if p.is_dir():
            raise ConfigError(f"{what} {str(p)!r} is a directory; give a file name.")
        if (p.exists() or p.is_symlink()) and not _is_marked(p):
            raise ConfigError(
                f"{what} {str(p)!r} exists and is not a file memfit wrote (it has no {MARKER!r} field), "
                "so it is not replaced; give a new file name (or remove that file first)."
            )
        _check_writable(_nearest_existing(p.parent), p, what)
    except OSError as exc:
        raise _unusable(p, what, exc) from None
    return p


def write_text(path: str | os.PathLike[str], text: str, what: str) -> Path:
    """Write ``text`` to ``path`` atomically (a temporary file renamed over it).

    Raises:
        ConfigError: the file cannot be written; the old file, if any, is untouched.
    """
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        try:
            os.fchmod(fd, 0o644)  # mkstemp makes 0600; an output file is for reading
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, p)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        raise ConfigError(f"cannot write {what} {str(p)!r} ({exc.strerror or exc}).") from None
    return p
