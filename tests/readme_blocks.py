"""The Python code blocks of README.md and docs/*.md, for the tests that run them as a reader
would paste them.

A block runs on its own (each is self-contained). An HTML comment on the line before its
fence marks what it needs: ``<!-- test: extras -->`` (transformers, lightning or accelerate:
run by ``tests/integrations/test_readme_extras.py`` in ``.venv-extras``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_MARK = re.compile(r"<!--\s*test:\s*(\w+)\s*-->")


def pages() -> list[Path]:
    """README.md, then every page of docs/ in name order."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


class Block(NamedTuple):
    """One fenced python block: where it is, its mark ("" or the test mark) and its code."""

    page: str
    line: int
    mark: str
    code: str

    @property
    def id(self) -> str:
        """``docs/planning.md:line42``: the page, relative to the repository, and the first code line."""
        return f"{self.page}:line{self.line}"


def python_blocks(page: Path = README) -> list[Block]:
    """Every fenced python block of ``page``, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    name = page.resolve().relative_to(ROOT).as_posix()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            end = lines.index("```", start)
            before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            mark = _MARK.search(before)
            code = "\n".join(lines[start:end]) + "\n"
            blocks.append(Block(name, start + 1, mark.group(1) if mark else "", code))
            i = end
        i += 1
    return blocks


def all_blocks() -> list[Block]:
    """The python blocks of every page (:func:`pages`), README first."""
    return [block for page in pages() for block in python_blocks(page)]


def run_block(block: Block) -> None:
    """Run one block as a script (its own globals), named by its page and line in tracebacks."""
    exec(compile(block.code, f"{block.page}:{block.line}", "exec"), {"__name__": "__main__"})
