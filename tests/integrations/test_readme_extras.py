"""The blocks of README.md and docs/*.md that need the extras (transformers, lightning,
accelerate) run as pasted."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from readme_blocks import Block, all_blocks, outside_out, run_block

EXTRAS = [pytest.param(b, id=b.id) for b in all_blocks() if b.mark == "extras"]
_NEEDS = ("transformers", "lightning", "accelerate")


@pytest.mark.parametrize("block", EXTRAS)
def test_docs_extras_block_runs_as_pasted(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for package in _NEEDS:
        if f"import {package}" in block.code or f"from {package}" in block.code:
            pytest.importorskip(package, reason=f"{package} is not installed")
    monkeypatch.chdir(tmp_path)
    _fresh_accelerate()
    run_block(block)
    assert outside_out(tmp_path, frozenset()) == [], f"{block.id} writes outside memfit-out/"


def _fresh_accelerate() -> None:
    """Each block runs as in a fresh Python: accelerate's process-wide state (its mixed
    precision, set by the Hugging Face Trainer block) is reset, as accelerate's own tests do."""
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
