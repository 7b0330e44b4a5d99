"""Without the optional extras, memfit says what to install instead of failing obscurely."""

from __future__ import annotations

import importlib.util

import pytest

from memfit.cli.main import main


@pytest.mark.skipif(importlib.util.find_spec("transformers") is not None, reason="transformers is installed")
def test_hf_model_without_transformers_names_the_extra(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--set", "model.name='hf:gpt2'"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'memfit[hf]'" in err and "Traceback" not in err
