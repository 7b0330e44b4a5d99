"""Hugging Face models built from configs (no download): blocks, numerics, plans, training."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="memfit[hf] extra (transformers) not installed")

import memfit  # noqa: E402
from memfit.cli.main import main  # noqa: E402
from memfit.errors import ConfigError  # noqa: E402
from memfit.integrations.hf import build_hf_causal_lm, checkpointing_owner, hf_causal_loss  # noqa: E402

#: Checkpointed and plain steps run the same fp32 kernels; recompute may reorder reductions.
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)
SMALL = dict(n_layer=2, n_embd=32, n_head=2, block_size=32)


def _batch(batch: int = 4, seq: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (batch, seq + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _model(name: str, **kw: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_hf_causal_lm(name, **{**SMALL, **kw})


@pytest.mark.parametrize(
    ("name", "cls", "blocks"),
    [
        ("gpt2", "GPT2LMHeadModel", ["transformer.h.0", "transformer.h.1"]),
        ("openai-community/gpt2", "GPT2LMHeadModel", ["transformer.h.0", "transformer.h.1"]),
        ("llama", "LlamaForCausalLM", ["model.layers.0", "model.layers.1"]),
        ("mistral", "MistralForCausalLM", ["model.layers.0", "model.layers.1"]),
        ("bert", "BertForMaskedLM", ["bert.encoder.layer.0", "bert.encoder.layer.1"]),
    ],
)
def test_blocks_found_in_models_built_from_config(name: str, cls: str, blocks: list[str]) -> None:
    model = _model(name)
    assert type(model).__name__ == cls
    assert memfit.find_blocks(model) == blocks
    assert model.config.vocab_size == 256


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_gradients_equal_plain(name: str, mode: str) -> None:
    plain = _model(name)
    ckpt = memfit.checkpoint(copy.deepcopy(plain), mode=mode)
    assert set(memfit.checkpointing.checkpointed_blocks(ckpt).values()) == {mode}
    batch = _batch()
    losses = []
    for model in (plain, ckpt):
        torch.manual_seed(1)  # GPT-2 has dropout: the same masks in both (checkpoint replays RNG)
        loss = hf_causal_loss(model, batch)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], **GRAD_TOL)
    for (n, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        assert a.grad is not None, n
        torch.testing.assert_close(b.grad, a.grad, **GRAD_TOL, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_plan_at_60_percent_holds_when_measured(name: str) -> None:
    model = _model(name, n_embd=16)
    batch = _batch(4, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = memfit.plan(model, batch, hf_causal_loss, "60%", opt, precision="fp32")
    assert plan.budget_bytes == int(0.6 * plan.report.baseline_peak_bytes)
    memfit.apply(model, plan)
    # the saving: checkpointed blocks, or micro-batches where the planner weighs them faster
    assert plan.micro_batches > 1 or any(m != "none" for m in plan.blocks.values())
    measured = memfit.measure(
        model, batch, hf_causal_loss, opt, "fp32", steps=1, micro_batches=plan.micro_batches
    )
    assert measured.peak_bytes <= plan.budget_bytes < plan.report.baseline_peak_bytes


def test_profile_and_estimate_work_on_hf_models() -> None:
    model = _model("llama", n_embd=16, block_size=16)
    batch = _batch(2, 16)
    prof = memfit.profile(model, batch, hf_causal_loss, torch.optim.AdamW(model.parameters()), "fp32")
    assert [b.name for b in prof.blocks] == ["model.layers.0", "model.layers.1"]
    assert all(b.saved_bytes["full"] < b.saved_bytes["none"] for b in prof.blocks)
    est = memfit.estimate(
        lambda: _model("llama", n_embd=16, block_size=16),
        batch,
        hf_causal_loss,
        lambda p: torch.optim.AdamW(p),
    )
    assert est.peak_bytes("fp32", "full") < est.peak_bytes("fp32", "none")


def test_huggingface_checkpointing_is_detected_not_doubled() -> None:
    model = _model("gpt2")
    assert checkpointing_owner(model) == "none"
    model.activation_checkpointing_enable()
    assert checkpointing_owner(model) == "huggingface"
    with pytest.raises(ConfigError, match=r"call model\.activation_checkpointing_disable\(\)"):
        memfit.checkpoint(model, mode="full")
    assert memfit.checkpointing.checkpointed_blocks(model) == {}
    model.activation_checkpointing_disable()
    memfit.checkpoint(model, mode="full")
    assert checkpointing_owner(model) == "memfit"
    model.activation_checkpointing_enable()  # the user turns it on afterwards: the Trainer refuses
    with pytest.raises(ConfigError, match="Hugging Face activation checkpointing is on"):
        memfit.Trainer(model, torch.optim.AdamW(model.parameters()), hf_causal_loss, "fp32")


def test_memfit_train_hf_config_name_and_local_directory(tmp_path: Path) -> None:
    data = tmp_path / "text.txt"
    data.write_bytes(Path(transformers.__file__).read_bytes() * 4)
    saved = tmp_path / "saved"
    local = _model("llama", block_size=16)
    local.save_pretrained(saved)
    common = [
        "--set", f"data.path='{data}'", "--set", "model.n_layer=2", "--set", "model.n_embd=32",
        "--set", "model.n_head=2", "--set", "model.block_size=16", "--set", "train.batch_size=2",
        "--set", "train.steps=2", "--set", "train.eval_every=0", "--set", "train.eval_batches=1",
        "--set", "memory.checkpointing='full'", "--quiet",
    ]  # fmt: skip
    for name, cls in (("hf:llama", "LlamaForCausalLM"), (f"hf:{saved}", "LlamaForCausalLM")):
        out = tmp_path / name.replace("/", "_").replace(":", "_")
        assert main(["train", *common, "--set", f"model.name='{name}'", "--set", f"train.out='{out}'"]) == 0
        assert (out / "state.pt").exists()
        assert (
            cls in (out / "report.md").read_text(encoding="utf-8") or name in (out / "report.md").read_text()
        )
    spec = memfit.app.build.build_model(
        memfit.app.config.load_config(None, [f"model.name='hf:{saved}'"]).model
    )
    for a, b in zip(spec.model.parameters(), local.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_unknown_hf_name_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--set", "model.name='hf:no-such-architecture'"]) == 2
    err = capsys.readouterr().err
    assert "cannot tell which Hugging Face architecture" in err and "Traceback" not in err
