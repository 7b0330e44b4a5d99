"""``maximize="seq_len"`` on a Hugging Face Llama wrapped in a peft LoRA adapter, small: the
answer trains under the budget, and its planned step's loss and gradients equal the plain
step's at that length (rtol 1e-4). The lever is the tiled MLP, which changes the step's
forward and backward and leaves gradients to compare (``fused_step`` steps inside the
backward; the state levers change only the optimizer's step)."""

from __future__ import annotations

import copy

import pytest
import torch

import memfit
from memfit.planning.longest_sequence import resize_sequence

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

EXACT = {"rtol": 1e-4, "atol": 1e-6}


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(input_ids=x, labels=x).loss
    return out


def _lora_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=172, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=500, tie_word_embeddings=False, use_cache=False,
        max_position_embeddings=1 << 16,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).train()
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    return peft.get_peft_model(model, lora)


def test_longest_sequence_of_a_lora_llama_trains_under_the_budget_exactly() -> None:
    model = _lora_llama()
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randint(0, 500, (1, 64), generator=torch.Generator().manual_seed(1))
    budget = 8 * 2**20
    plan = memfit.plan(
        model, x, _loss, budget, opt, "fp32", levers=["tiled_mlp", "chunked_loss"], maximize="seq_len"
    )
    n = plan.seq_len
    assert n > 64 and 0 < plan.measured_peak_bytes <= budget
    sized = resize_sequence(x, n)
    done = memfit.apply(model, plan, opt)
    loss, ref = _loss(done.model, sized), _loss(plain, sized)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref, **EXACT)
    grads = [(n_, p.grad) for n_, p in model.named_parameters() if p.requires_grad]
    refs = [p.grad for p in plain.parameters() if p.requires_grad]
    assert len(grads) == len(refs) > 0
    for (name, g), r in zip(grads, refs, strict=True):
        assert g is not None and r is not None, name
        torch.testing.assert_close(g, r, **EXACT)
