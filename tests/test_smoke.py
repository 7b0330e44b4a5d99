"""The package imports, and the CLI answers."""

from __future__ import annotations

import memfit
from memfit.cli.main import main


def test_public_api_names_exist() -> None:
    for name in memfit.__all__:
        assert hasattr(memfit, name), name


def test_doctor_runs(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "recommendation" in out
