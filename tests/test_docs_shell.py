"""Every shell block of README.md and docs/*.md runs as pasted: page by page (README first), in
order, in one fresh folder that stands in for a fresh clone's root (its ``examples/``), with
``memfit`` running this interpreter. Every command must exit 0, and because all pages share
the folder, two commands writing the same output fail as they would for a reader.

Blocks marked ``slow`` run when ``MEMFIT_DOCS_SLOW=1``; ``extras`` blocks run in
``tests/integrations/test_docs_shell_extras.py``; ``skip`` blocks (``make``, ``pip``) build
environments and never run here (``make test`` is what runs this file).
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
from readme_blocks import (
    ROOT,
    SHELLS,
    Block,
    all_shell_blocks,
    commands,
    fresh_clone,
    outside_out,
    pages,
    run_shell,
)

BLOCKS = all_shell_blocks()
SLOW = os.environ.get("MEMFIT_DOCS_SLOW", "") not in ("", "0")
_MARKS = {"", "slow", "skip", "extras"}
#: The first word of every command a ``skip`` block may hold.
_NOT_RUN = ("make", "pip")
_FENCE = re.compile(r"^```(\S*)", re.MULTILINE)


def _lines(block: Block) -> list[str]:
    """The commands of a block, one per entry (continuation lines joined, comments dropped)."""
    joined = commands(block).replace("\\\n", " ")
    return [ln.split(" #")[0].strip() for ln in joined.splitlines() if ln.strip() and not ln.startswith("#")]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    folder = tmp_path_factory.mktemp("docs-shell") / "clone"
    folder.mkdir()
    return folder, fresh_clone(folder)


def test_every_shell_block_is_found_and_marked_for_a_reason() -> None:
    fences = {lang for page in pages() for lang in _FENCE.findall(page.read_text(encoding="utf-8"))}
    assert fences <= {"", "python", "text", "toml", "json", *SHELLS}, fences - {"", "python", *SHELLS}
    assert {b.mark for b in BLOCKS} <= _MARKS, {b.mark for b in BLOCKS} - _MARKS
    for block in BLOCKS:
        if block.mark == "skip":
            assert all(ln.split()[0] in _NOT_RUN for ln in _lines(block)), (
                f"{block.id} is marked skip but runs more than {'/'.join(_NOT_RUN)}"
            )
    ran = " ".join(ln for b in BLOCKS if b.mark in ("", "slow") for ln in _lines(b))
    for command in ("doctor", "plan", "train", "estimate", "profile", "bench", "check"):
        assert f"memfit {command}" in ran, f"no shell block shows `memfit {command}`"


def test_shell_blocks_name_only_files_in_the_repository() -> None:
    for block in BLOCKS:
        for line in _lines(block):
            for word in shlex.split(line):
                if word.startswith("examples/"):
                    assert (ROOT / word).exists(), f"{block.id} names {word}, which is not in the repository"


@pytest.mark.parametrize(
    "block", [pytest.param(b, id=b.id) for b in BLOCKS if b.mark not in ("skip", "extras")]
)
def test_docs_shell_block_runs_as_pasted(block: Block, clone: tuple[Path, dict[str, str]]) -> None:
    if block.mark == "slow" and not SLOW:
        pytest.skip("marked slow: MEMFIT_DOCS_SLOW=1 runs it")
    folder, env = clone
    run_shell(block, folder, env)
    assert outside_out(folder) == [], f"{block.id} writes outside memfit-out/"
