"""The README's Python code blocks, for the tests that run them as a reader would paste them.

A block runs on its own (each is self-contained). An HTML comment on the line before its
fence marks what it needs: ``<!-- test: extras -->`` (transformers, lightning or accelerate:
run by ``tests/integrations/test_readme_extras.py`` in ``.venv-extras``).
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
_MARK = re.compile(r"<!--\s*test:\s*(\w+)\s*-->")


def python_blocks(readme: Path = README) -> list[tuple[int, str, str]]:
    """``(line, mark, code)`` for every fenced python block; ``mark`` is "" or the test mark."""
    lines = readme.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            end = lines.index("```", start)
            before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            mark = _MARK.search(before)
            blocks.append((start + 1, mark.group(1) if mark else "", "\n".join(lines[start:end]) + "\n"))
            i = end
        i += 1
    return blocks


def run_block(line: int, code: str) -> None:
    """Run one block as a script (its own globals), named by its README line in tracebacks."""
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__main__"})
