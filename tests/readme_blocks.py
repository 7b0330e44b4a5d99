"""The code blocks of README.md and docs/*.md, for the tests that run them as a reader would
paste them: the Python blocks (``tests/test_readme.py``) and the shell blocks
(``tests/test_docs_shell.py``).

A Python block runs on its own (each is self-contained). The shell blocks of all pages are
run in page order in one fresh folder, as a reader pastes them into a fresh clone's root.
An HTML comment on the line before a fence marks what the block needs, optionally followed
by why (``<!-- test: skip: builds .venv -->``):

- ``extras``: transformers, lightning or accelerate; run in ``.venv-extras`` by
  ``tests/integrations/test_readme_extras.py`` (Python) and
  ``tests/integrations/test_docs_shell_extras.py`` (shell);
- ``slow`` (shell only): minutes on a CPU; run when ``MEMFIT_DOCS_SLOW=1``;
- ``skip`` (shell only): ``make`` and ``pip`` lines, which build environments; never run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_MARK = re.compile(r"<!--\s*test:\s*(\w+)\b[^>]*-->")
#: The fence languages of shell blocks.
SHELLS = ("bash", "sh", "shell", "console")


def pages() -> list[Path]:
    """README.md, then every page of docs/ in name order."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


class Block(NamedTuple):
    """One fenced block: where it is, its mark ("" or the test mark), its code and its language."""

    page: str
    line: int
    mark: str
    code: str
    lang: str = "python"

    @property
    def id(self) -> str:
        """``docs/planning.md:line42``: the page, relative to the repository, and the first code line."""
        return f"{self.page}:line{self.line}"


def _blocks(page: Path, langs: tuple[str, ...]) -> list[Block]:
    """Every fenced block of ``page`` whose language is one of ``langs``, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    name = page.resolve().relative_to(ROOT).as_posix()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang = lines[i].strip()[3:].strip()
            start = i + 1
            end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
            if lang in langs:
                before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
                mark = _MARK.search(before)
                code = "\n".join(lines[start:end]) + "\n"
                blocks.append(Block(name, start + 1, mark.group(1) if mark else "", code, lang))
            i = end
        i += 1
    return blocks


def python_blocks(page: Path = README) -> list[Block]:
    """Every fenced python block of ``page``, in order."""
    return _blocks(page, ("python",))


def shell_blocks(page: Path = README) -> list[Block]:
    """Every fenced shell block (``bash``, ``sh``, ``shell``, ``console``) of ``page``, in order."""
    return _blocks(page, SHELLS)


def all_shell_blocks() -> list[Block]:
    """The shell blocks of every page (:func:`pages`), README first."""
    return [block for page in pages() for block in shell_blocks(page)]


def commands(block: Block) -> str:
    """The script a reader pastes: a console block's ``$ `` lines (and their continuations,
    without the prompt and the output), any other shell block as it is."""
    if block.lang != "console":
        return block.code
    out, going_on = [], False
    for line in block.code.splitlines():
        if line.startswith("$ ") or going_on:
            out.append(line[2:] if line.startswith("$ ") and not going_on else line)
            going_on = line.rstrip().endswith("\\")
    return "\n".join(out) + "\n"


def all_blocks() -> list[Block]:
    """The python blocks of every page (:func:`pages`), README first."""
    return [block for page in pages() for block in python_blocks(page)]


def fresh_clone(folder: Path) -> dict[str, str]:
    """Make ``folder`` stand in for a fresh clone's root, as the shell blocks need it: the
    repository's ``examples/``, and ``memfit``, ``python`` and ``torchrun`` on ``PATH`` running
    this interpreter with this checkout's ``src`` first on ``PYTHONPATH``. Only ``examples/``
    is copied, so a block that names any other file of the clone fails here.

    Returns:
        The environment to run the blocks in.
    """
    shutil.copytree(ROOT / "examples", folder / "examples")
    bin_dir = folder.parent / f"{folder.name}-bin"
    bin_dir.mkdir()
    python = shlex.quote(sys.executable)
    for name, run in {
        "memfit": f"{python} -m memfit",
        "python": python,
        "python3": python,
        "torchrun": f"{python} -m torch.distributed.run",
    }.items():
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {run} "$@"\n', encoding="utf-8")
        shim.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT / "src"), env.get("PYTHONPATH", "")] if p)
    # one intra-op thread, as tests/conftest.py sets for the tests themselves: on a shared CPU
    # torch's threads cost more than they gain (steps 5-50x slower under load).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MPLBACKEND", "Agg")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def run_shell(block: Block, folder: Path, env: dict[str, str], timeout: float = 1200) -> str:
    """Run one shell block in ``folder`` with bash (``-e``: every command must exit 0).

    Returns:
        What it printed (stdout and stderr together).

    Raises:
        AssertionError: a command failed; the message has the block's id and the output's tail.
    """
    script = "set -euo pipefail -x\n" + commands(block)
    done = subprocess.run(
        ["bash", "-c", script],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    tail = "\n".join(done.stdout.splitlines()[-40:])
    assert done.returncode == 0, f"{block.id} exited with {done.returncode}:\n{tail}"
    return done.stdout


#: What the clone's root holds before any block ran (fresh_clone), and where blocks write.
CLONE = frozenset({"examples"})
OUT = "memfit-out"


def outside_out(folder: Path, before: frozenset[str] = CLONE) -> list[str]:
    """What is in ``folder`` besides ``before`` and ``memfit-out/``: what a block left outside
    the one folder the docs write into (issue 37: ``plan.json`` and ``state.pt`` in the root,
    not ignored by git, broke the README's own ``memfit plan`` afterwards)."""
    return sorted(p.name for p in folder.iterdir() if p.name not in before and p.name != OUT)


def run_block(block: Block) -> None:
    """Run one block as a script (its own globals), named by its page and line in tracebacks."""
    exec(compile(block.code, f"{block.page}:{block.line}", "exec"), {"__name__": "__main__"})
