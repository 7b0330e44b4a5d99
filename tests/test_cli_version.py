"""``memfit --version``."""

from __future__ import annotations

import pytest

import memfit
from memfit.cli.main import main


def test_version_prints_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"memfit {memfit.__version__}"
