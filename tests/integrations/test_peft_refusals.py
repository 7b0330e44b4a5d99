"""Adapters memfit cannot take are refused in one sentence that names the fix, with nothing applied:
peft missing for ``[model.lora]`` (exit 2 at the CLI), and peft's prefix tuning, whose prefix
reaches every layer through the cache a checkpointed layer runs without."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import memfit
from memfit.checkpointing import checkpointed_blocks
from memfit.cli.main import main
from memfit.errors import ConfigError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = ["--set", "model.n_layer=1", "--set", "model.n_embd=16", "--set", "model.n_head=2"]


@pytest.mark.skipif(importlib.util.find_spec("peft") is not None, reason="peft is installed")
def test_lora_without_peft_names_the_extra(capsys: pytest.CaptureFixture[str]) -> None:
    lora = ["--set", "model.lora.rank=4", "--set", "model.lora.target_modules=['qkv']"]
    assert main(["plan", *TINY, *lora, "--budget", "60%"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'memfit[peft]'" in err and "Traceback" not in err


def _prefix_tuned() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    prefix = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    return peft.get_peft_model(transformers.LlamaForCausalLM(config), prefix)


def test_prefix_tuning_is_refused_before_anything_is_checkpointed() -> None:
    model = _prefix_tuned()
    x = torch.randint(0, 96, (4, 16))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    said = (
        r"peft's prefix tuning hands every layer its prefix through the model's cache.*LoRA, DoRA or prompt"
    )
    with pytest.raises(ConfigError, match=said):
        memfit.checkpoint(model, mode="full")
    with pytest.raises(ConfigError, match=said):
        memfit.plan(model, x, lambda m, b: m(input_ids=b, labels=b).loss, "50%", opt, "fp32")
    assert checkpointed_blocks(model) == {}
    # and without checkpointing it trains as peft made it
    model(input_ids=x, labels=x).loss.backward()
