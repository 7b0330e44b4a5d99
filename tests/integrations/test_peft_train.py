"""``memfit train`` with a ``[model.lora]`` table: a Hugging Face model from its config trains its
adapters only, resumes bit for bit, and refuses bad adapter settings in one sentence (exit 2)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="memfit[peft] extra (transformers) not installed")
pytest.importorskip("peft", reason="memfit[peft] extra (peft) not installed")

from memfit.app.build import build_model, store_frozen_base
from memfit.app.config import load_config
from memfit.app.run import train_from_config
from memfit.cli.main import main
from memfit.levers import frozen
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


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal as stored: an NF4 weight's codes, block scales and their scales, bit for bit."""
    if not frozen.is_nf4(x) or not frozen.is_nf4(y):
        return not frozen.is_nf4(x) and not frozen.is_nf4(y) and torch.equal(x, y)
    names = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
    return all(torch.equal(getattr(x, n).clone(), getattr(y, n).clone()) for n in names)


def _split_and_resumed(tmp_path: Path, data: Path, straight: Any, settings: list[str]) -> tuple[Any, dict]:
    """Train 3 steps, resume to the end; assert the run equals ``straight`` bit for bit (losses,
    validation losses, every stored tensor); return the resumed config and straight's state."""
    first = _config(tmp_path, data, "split", steps=3)
    train_from_config(load_config(first, settings), progress=False, echo=_quiet)
    cfg = load_config(first, [*settings, f"train.steps={STEPS}"])
    resumed = train_from_config(cfg, resume=str(tmp_path / "split" / "state.pt"), progress=False, echo=_quiet)
    assert resumed.resumed_from == 3
    got = read_metrics(tmp_path / "split" / "metrics.jsonl")
    assert [m.loss for m in got] == [m.loss for m in straight.history]  # bit for bit
    assert [m.val_loss for m in got] == [m.val_loss for m in straight.history]
    a = load_state(straight.state_path)["model"]
    b = load_state(resumed.state_path)["model"]
    assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return cfg, a


def test_lora_section_trains_adapters_and_resumes_bit_for_bit(tmp_path: Path, text_file: Path) -> None:
    whole = load_config(_config(tmp_path, text_file, "straight"))
    straight = train_from_config(whole, progress=False, echo=_quiet)
    assert type(straight.trainer.model).__name__ == "PeftModel"
    cfg, a = _split_and_resumed(tmp_path, text_file, straight, [])
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
        ("model.lora.base='int8'", 'set model.lora.base = "fp32", "bf16" or "nf4"'),
        ("model.lora.base='bf16'", 'set memory.precision = "bf16" (or model.lora.base = "fp32")'),
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


@pytest.mark.parametrize("base", ["bf16", "nf4"])
def test_a_bf16_or_nf4_base_trains_the_adapters_and_resumes_bit_for_bit(
    tmp_path: Path, text_file: Path, base: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if base == "nf4":
        pytest.importorskip("torchao", reason="frozen_nf4 needs torchao")
    # n_embd 128: every projection's size divides NF4's 64 x 256 blocks
    settings = [f"model.lora.base='{base}'", "memory.precision='auto'", "model.n_embd=128"]
    straight = train_from_config(
        load_config(_config(tmp_path, text_file, "straight"), settings), progress=False
    )
    line = capsys.readouterr().out
    assert f"bf16, checkpointing full, cpu, frozen base {base} (" in line, line
    assert straight.trainer.precision.mode == "bf16"
    report = (tmp_path / "straight" / "report.md").read_text(encoding="utf-8")
    assert "frozen base" in report and f"{base} (" in report
    cfg, a = _split_and_resumed(tmp_path, text_file, straight, settings)
    # the frozen base is a fresh build stored the same way; only the adapters trained
    torch.manual_seed(3)
    model = build_model(cfg.model).model
    store_frozen_base(model, cfg.model.lora)
    fresh = model.state_dict()
    adapters = [k for k in a if "lora_" in k]
    frozen_keys = [k for k in a if k not in adapters]
    assert adapters and all(_same(a[k], fresh[k]) for k in frozen_keys)
    assert any(not torch.equal(a[k], fresh[k]) for k in adapters)
    assert all(a[k].dtype == torch.float32 for k in adapters)  # the adapters train in fp32
    dtypes = {k: a[k].dtype for k in frozen_keys if not frozen.is_nf4(a[k])}
    assert dtypes and set(dtypes.values()) == {torch.bfloat16}, dtypes
    nf4 = [k for k in frozen_keys if frozen.is_nf4(a[k])]
    assert (base == "nf4") == bool(nf4) and all("proj" in k for k in nf4)


def test_an_nf4_base_with_nothing_to_quantize_is_refused_before_it_changes_the_model(
    tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torchao", reason="frozen_nf4 needs torchao")
    config = _config(tmp_path, text_file, "small")  # n_embd 32: no weight NF4's blocks divide
    assert main(["train", str(config), "--set", "model.lora.base=nf4", "--set", "memory.precision=bf16"]) == 2
    err = capsys.readouterr().err
    assert 'this model has none; set model.lora.base = "bf16"' in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "small" / "state.pt").exists()


def test_an_nf4_base_without_torchao_is_one_sentence_and_nothing_is_written(
    tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(frozen, "nf4_available", lambda: False)
    monkeypatch.setattr("memfit.app.build.nf4_available", lambda: False)
    config = _config(tmp_path, text_file, "bad")
    assert main(["train", str(config), "--set", "model.lora.base=nf4", "--set", "memory.precision=bf16"]) == 2
    err = capsys.readouterr().err
    assert "torchao is not installed: `pip install torchao` adds it" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "bad").exists()


def test_set_model_lora_base_nf4_trains_the_built_in_gpt_with_its_linears_in_nf4(
    tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torchao", reason="frozen_nf4 needs torchao")
    out = tmp_path / "gpt"
    settings = [
        "model.name=gpt", "model.n_layer=2", "model.n_embd=128", "model.n_head=4", "model.block_size=16",
        "model.lora.rank=4", "model.lora.target_modules=['qkv']", "model.lora.base=nf4",
        "memory.precision=auto", f"data.path={text_file}", "train.batch_size=2", "train.steps=2",
        "train.eval_every=0", f"train.out={out}",
    ]  # fmt: skip
    assert main(["train", *(a for s in settings for a in ("--set", s)), "--quiet"]) == 0
    state = load_state(out / "state.pt")["model"]
    nf4 = sorted(k for k, v in state.items() if frozen.is_nf4(v))
    # every frozen Linear but the output head is NF4 (the adapted qkv's base weight too); the rest bf16
    assert nf4 and all(k.endswith(("qkv.base_layer.weight", "proj.weight", "fc.weight")) for k in nf4), nf4
    assert not any("head" in k for k in nf4)
    rest = {v.dtype for k, v in state.items() if "lora_" not in k and k not in nf4 and v.is_floating_point()}
    assert rest == {torch.bfloat16}, rest
    assert {state[k].dtype for k in state if "lora_" in k} == {torch.float32}


def test_memfit_plan_from_the_config_plans_the_base_as_train_stores_it(
    tmp_path: Path, text_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import memfit.cli.plan as plan_cli

    seen: dict[str, set[torch.dtype]] = {}
    planner = plan_cli.plan

    def spy(model: torch.nn.Module, *args: object, **kwargs: object) -> object:
        seen["frozen"] = {p.dtype for p in model.parameters() if not p.requires_grad}
        seen["trained"] = {p.dtype for p in model.parameters() if p.requires_grad}
        return planner(model, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(plan_cli, "plan", spy)
    config = _config(tmp_path, text_file, "planned")
    out = tmp_path / "plan.json"
    settings = ["model.lora.base=bf16", "memory.precision=auto"]
    assert main(["plan", str(config), *(a for s in settings for a in ("--set", s)), "--budget", "90%",
                 "--out", str(out), "--no-check"]) == 0  # fmt: skip
    assert seen == {"frozen": {torch.bfloat16}, "trained": {torch.float32}}
    plan = json.loads(out.read_text(encoding="utf-8"))
    assert plan["precision"] == "bf16"  # auto is bf16 for a bf16 base, as memfit train runs it
