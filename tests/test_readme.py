"""Every Python block of README.md and docs/*.md runs as pasted (the extras' blocks run in
tests/integrations/test_readme_extras.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from readme_blocks import README, Block, all_blocks, outside_out, python_blocks, run_block

BLOCKS = all_blocks()


def test_the_readme_and_docs_have_the_examples_the_issue_asks_for() -> None:
    first = python_blocks(README)[0].code
    assert "memfit.prepare(" in first and "memfit.train_step(" in first, (
        "the first README example is the own loop"
    )
    extras = "".join(b.code for b in BLOCKS if b.mark == "extras")
    for name in ("memfit.integrations.hf.prepare(", "MemfitCallback(", "accelerator_kwargs("):
        assert name in extras, name
    assert {b.mark for b in BLOCKS} <= {"", "extras"}


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in BLOCKS if not b.mark])
def test_docs_block_runs_as_pasted(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run_block(block)
    assert outside_out(tmp_path, frozenset()) == [], f"{block.id} writes outside memfit-out/"
