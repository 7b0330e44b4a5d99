"""``memfit train`` with a ``[model.lora]`` table: a Hugging Face model from its config trains its
adapters only, resumes bit for bit, and refuses bad adapter settings in one sentence (exit 2)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="memfit[peft] extra (transformers) not installed")
pytest.importorskip("peft", reason="memfit[peft] extra (peft) not installed")

from memfit.app.build import build_model
from memfit.app.config import load_config
from memfit.app.run import train_from_config
from memfit.cli.main import main
from memfit.trainer.callbacks import read_metrics
from memfit.trainer.state import load_state

STEPS = 6
CONFIG = """
[model]
name = "hf:llama"
n_layer = 2
n_embd = 32
n_head = 4
block_size = 16

[model.lora]
rank = 4
alpha = 8
target_modules = ["q_proj", "v_proj"]
dropout = 0.1

[data]
path = "{data}"
val_fraction = 0.1

[train]
batch_size = 4
steps = {steps}
eval_every = 3
eval_batches = 1
checkpoint_every = 3
out = "{out}"
seed = 3

[memory]
checkpointing = "full"
precision = "fp32"
"""


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    source = Path(json.__file__).parent
    path.write_bytes(b"\n".join(p.read_bytes() for p in sorted(source.glob("*.py"))))
    return path


def _config(tmp_path: Path, data: Path, name: str, steps: int = STEPS) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(CONFIG.format(data=data, out=tmp_path / name, steps=steps), encoding="utf-8")
    return path


def _quiet(_line: str) -> None:
    pass


def test_lora_section_trains_adapters_and_resumes_bit_for_bit(tmp_path: Path, text_file: Path) -> None:
    whole = load_config(_config(tmp_path, text_file, "straight"))
    straight = train_from_config(whole, progress=False, echo=_quiet)
    assert type(straight.trainer.model).__name__ == "PeftModel"
    first = _config(tmp_path, text_file, "split", steps=3)
    train_from_config(load_config(first), progress=False, echo=_quiet)
    cfg = load_config(first, [f"train.steps={STEPS}"])
    resumed = train_from_config(cfg, resume=str(tmp_path / "split" / "state.pt"), progress=False, echo=_quiet)
    assert resumed.resumed_from == 3
    got = read_metrics(tmp_path / "split" / "metrics.jsonl")
    assert [m.loss for m in got] == [m.loss for m in straight.history]  # bit for bit
    assert [m.val_loss for m in got] == [m.val_loss for m in straight.history]
    a = load_state(straight.state_path)["model"]
    b = load_state(resumed.state_path)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the frozen base is the model as built; the adapters trained
    torch.manual_seed(3)
    fresh = build_model(cfg.model).model.state_dict()
    adapters = [k for k in a if "lora_" in k]
    assert adapters and all(torch.equal(a[k], fresh[k]) for k in a if k not in adapters)
    assert any(not torch.equal(a[k], fresh[k]) for k in adapters)


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("model.lora.target_modules=['qproj']", "no module named 'qproj' to put adapters on"),
        ("model.lora.method='ia3'", "model.lora.method 'ia3' is not one of lora, dora"),
        ("model.lora.base='nf4'", 'set model.lora.base = "fp32"'),
        ("model.lora.dropout=1.5", "model.lora.dropout must be a finite number in [0, 1)"),
    ],
)
def test_bad_adapter_settings_are_one_sentence_and_exit_2(
    tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str], setting: str, said: str
) -> None:
    config = _config(tmp_path, text_file, "bad")
    assert main(["train", str(config), "--set", setting, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "bad" / "state.pt").exists()
