"""The shell blocks of README.md and docs/*.md that need the extras (marked
``<!-- test: extras -->``: transformers and friends) run as pasted, in page order, in one
fresh folder standing in for a fresh clone's root (``tests/test_docs_shell.py`` runs the rest)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from readme_blocks import Block, all_shell_blocks, fresh_clone, outside_out, run_shell

EXTRAS = [pytest.param(b, id=b.id) for b in all_shell_blocks() if b.mark == "extras"]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    folder = tmp_path_factory.mktemp("docs-shell-extras") / "clone"
    folder.mkdir()
    return folder, fresh_clone(folder)


@pytest.mark.parametrize("block", EXTRAS)
def test_docs_extras_shell_block_runs_as_pasted(block: Block, clone: tuple[Path, dict[str, str]]) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    folder, env = clone
    run_shell(block, folder, env)
    assert outside_out(folder) == [], f"{block.id} writes outside memfit-out/"
