"""Docstrings and docs pages name only what exists: every dotted ``memfit.`` name they give
imports (a module, or an attribute of one), and every design note is referred to somewhere.

Names under an optional extra (transformers, Lightning, accelerate...) are checked where the
extra is installed (the extras suite runs this file too).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "memfit"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: A dotted name: ``memfit.`` and identifiers (not a path, a file name or an extra in brackets).
_NAME = re.compile(r"(?<![\w/.\[-])memfit(?:\.[A-Za-z_]\w*)+")
#: Endings that make a dotted word a file name, not a Python name.
_FILES = (".py", ".md", ".json", ".toml", ".txt", ".pt", ".png", ".csv", ".jsonl", ".html")
_EXTRAS = ("transformers", "lightning", "accelerate", "peft", "timm", "torchvision")
#: Dotted words that are not Python names: the ``logging`` loggers memfit writes to.
_LOGGERS = {"memfit.guard", "memfit.oom"}


def _docstrings() -> dict[str, set[str]]:
    """Every dotted name in the sources' text (docstrings and comments) and the docs pages."""
    found: dict[str, set[str]] = {}
    for path in [*sorted(SRC.rglob("*.py")), *PAGES]:
        for name in _NAME.findall(path.read_text(encoding="utf-8")):
            if not name.endswith(_FILES) and name not in _LOGGERS:
                found.setdefault(name.rstrip("."), set()).add(str(path.relative_to(ROOT)))
    return found


def _resolves(name: str) -> bool:
    """Whether ``name`` is a module, or an attribute (at any depth) of the longest module it starts
    with; a module's attribute must be one it makes public (its ``__all__``, or a submodule)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] in _EXTRAS:
                pytest.skip(f"{name} needs {exc.name}, not installed here")
            continue
        for attr in parts[cut:]:
            public = getattr(obj, "__all__", None) if isinstance(obj, types.ModuleType) else None
            if (
                isinstance(obj, type)
                and dataclasses.is_dataclass(obj)
                and attr in {f.name for f in dataclasses.fields(obj)}
            ):
                return True  # a dataclass field (one with a default factory is no class attribute)
            if not hasattr(obj, attr) or (
                public is not None and attr not in public and not attr.startswith("__")
            ):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_name_in_the_docs_exists() -> None:
    missing: dict[str, set[str]] = {}
    checked = 0
    for name, where in sorted(_docstrings().items()):
        try:
            ok = _resolves(name)
        except pytest.skip.Exception:
            continue
        checked += 1
        if not ok:
            missing[name] = where
    assert checked > 200  # the scan found the names (not an empty pass)
    assert missing == {}


def test_the_name_check_finds_a_name_that_does_not_exist() -> None:
    assert _resolves("memfit.applying.apply_plan.apply")
    assert not _resolves("memfit.measuring.memory.MemoryWatch")
    assert not _resolves("memfit.GuardConfig")
    assert _NAME.findall("see memfit.plan, src/memfit/apply.py and memfit[levers]") == ["memfit.plan"]


_DEFINED = re.compile(r"^\s*# Note \[([^\]]+)\]\s*$", re.M)
_REFERRED = re.compile(r"Note \[([^\]]+)\]")


def test_every_note_is_referred_to() -> None:
    """A named note is design reasoning told once and referred to where it matters; one referred
    to nowhere is a comment (See Note [...] in the code, or the docs pages)."""
    texts = [p.read_text(encoding="utf-8") for p in [*SRC.rglob("*.py"), *PAGES]]
    defined = {n for t in texts for n in _DEFINED.findall(t)}
    referred = {
        n
        for t in texts
        for line in t.splitlines()
        if not _DEFINED.match(line)
        for n in _REFERRED.findall(line)
    }
    assert sorted(defined - referred) == []
