"""Issue 25's acceptance on a PEFT model: a Llama-style LoRA model (hidden 512, 4 layers,
batch 1 x 64) whose frozen base dominates its step, planned with ``levers="all"`` under 0.9x
the frozen base held in bf16: the plan holds the base in NF4, fits when measured, and trains.
"""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit.integrations.hf import hf_causal_loss
from memfit.levers.frozen import frozen_params, is_nf4

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("torchao")


def _lora_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=64,
    )
    base = transformers.LlamaForCausalLM(config)
    return peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2048, (1, 65), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_a_4bit_base_fits_under_the_bf16_base_and_trains() -> None:
    model, batch = _lora_llama(), _batch()
    budget = int(0.9 * 2 * sum(p.numel() for p in frozen_params(model)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    plan = memfit.plan(model, batch, hf_causal_loss, budget, opt, "bf16", levers="all")
    assert "frozen_nf4" in plan.levers, plan.notes
    assert plan.measured_peak_bytes <= budget
    # planning left the user's model as it was
    assert not any(is_nf4(p) for p in model.parameters())
    model, opt = memfit.prepare(model, opt, plan)
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert is_nf4(base.weight) and not is_nf4(model.base_model.model.lm_head.weight)
    losses = [float(memfit.train_step(model, batch, hf_causal_loss, opt, plan)) for _ in range(3)]
    assert losses[2] < losses[0], losses
    assert memfit.measure(model, batch, hf_causal_loss, opt, plan.precision, steps=1).peak_bytes <= budget


def test_all_levers_on_a_generous_budget_keep_the_base() -> None:
    model, batch = _lora_llama(), _batch()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    plain = memfit.measure(model, batch, hf_causal_loss, opt, "bf16", steps=1).peak_bytes
    plan = memfit.plan(model, batch, hf_causal_loss, int(plain * 1.1), opt, "bf16", levers="all")
    assert not {"frozen_bf16", "frozen_nf4"} & set(plan.levers)
