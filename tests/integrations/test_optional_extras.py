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


@pytest.mark.skipif(importlib.util.find_spec("lightning") is not None, reason="lightning is installed")
def test_lightning_callback_without_lightning_names_the_package() -> None:
    from memfit.errors import ConfigError
    from memfit.integrations.lightning import MemfitCallback
    from memfit.records import Plan

    with pytest.raises(ConfigError, match="pip install lightning"):
        MemfitCallback(Plan(blocks={}))


@pytest.mark.skipif(importlib.util.find_spec("transformers") is not None, reason="transformers is installed")
def test_hf_prepare_without_transformers_names_the_extra() -> None:
    from torch import nn

    from memfit.errors import ConfigError
    from memfit.integrations.hf import prepare

    with pytest.raises(ConfigError, match=r"pip install 'memfit\[hf\]'"):
        prepare(nn.Linear(2, 2), object(), [], budget="60%")
