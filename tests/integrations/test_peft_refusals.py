"""Adapters memfit cannot take are refused in one sentence that names the fix, with nothing applied:
peft missing for ``[model.lora]`` (exit 2 at the CLI); peft's prefix tuning, whose prefix reaches
every layer through the cache a checkpointed layer runs without; and activated LoRA, whose
offsets come from hooks that are gone when a checkpointed layer recomputes (peft issue 2826)."""

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


def _llama_with(method: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    if method == "prefix":
        adapters: object = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    else:  # activated LoRA: adapters act after the invocation token (peft issue 2826)
        adapters = peft.LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"],
                                   alora_invocation_tokens=[7])  # fmt: skip
    return peft.get_peft_model(transformers.LlamaForCausalLM(config), adapters)


REFUSED = {
    "prefix": r"peft's prefix tuning hands every layer its prefix through the model's cache.*LoRA, DoRA",
    "alora": r"peft's activated LoRA \(alora_invocation_tokens\) hands each adapter its offsets through",
}


@pytest.mark.parametrize("method", list(REFUSED))
def test_methods_a_recompute_cannot_replay_are_refused_before_anything_is_checkpointed(method: str) -> None:
    model = _llama_with(method)
    x = torch.randint(1, 96, (4, 16))
    x[:, 4] = 7  # the invocation token
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(ConfigError, match=REFUSED[method]):
        memfit.checkpoint(model, mode="full")
    with pytest.raises(ConfigError, match=REFUSED[method]):
        memfit.plan(model, x, lambda m, b: m(input_ids=b, labels=b).loss, "50%", opt, "fp32")
    assert checkpointed_blocks(model) == {}
    # and without checkpointing it trains as peft made it
    model(input_ids=x, labels=x).loss.backward()
