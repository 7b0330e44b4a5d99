"""Every Python block of the README runs as pasted (the extras' blocks in test_readme_extras.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from readme_blocks import python_blocks, run_block

BLOCKS = python_blocks()


def test_the_readme_has_the_examples_the_issue_asks_for() -> None:
    first = BLOCKS[0][2]
    assert "memfit.prepare(" in first and "memfit.train_step(" in first, "the first example is the own loop"
    extras = "".join(code for _, mark, code in BLOCKS if mark == "extras")
    for name in ("memfit.integrations.hf.prepare(", "MemfitCallback(", "accelerator_kwargs("):
        assert name in extras, name
    assert {mark for _, mark, _ in BLOCKS} <= {"", "extras"}


@pytest.mark.parametrize(
    ("line", "code"), [pytest.param(ln, code, id=f"line{ln}") for ln, mark, code in BLOCKS if not mark]
)
def test_readme_block_runs_as_pasted(
    line: int, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # blocks write plan.json, state.pt ...
    run_block(line, code)
